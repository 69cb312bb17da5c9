"""The root of every error moriio-fsm raises on purpose.

Each family (spec problems, binding failures, layout problems, wire and transport
problems, engine availability) derives from ``MoriioFsmError`` and, where one fits, from
the built-in error a caller would already catch (``ValueError`` for bad input, ...), so
``except MoriioFsmError`` catches everything the package raises deliberately.
"""

from __future__ import annotations


class MoriioFsmError(Exception):
    """Base class of every error this package raises deliberately."""
