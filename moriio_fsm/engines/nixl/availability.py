"""Whether NIXL (PyPI ``nixl``) can be used in this process, and its Python API once it can.

Rules: ``probe_nixl`` never raises and never crashes this process (``isolated`` tries the import in a child first);
``nixl`` is imported through this module and nowhere else; NIXL's own logger is moved off stdout, which belongs
to the program.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

from ...errors import MoriioFsmError
from ..probe import Availability, ImportProbe

__all__ = ["NixlAvailability", "NixlUnavailableError", "nixl_api", "probe_nixl"]


class NixlUnavailableError(MoriioFsmError, RuntimeError):
    """NIXL cannot be used in this process; the message says why."""


NixlAvailability = Availability


def _quiet_stdout_logging() -> None:
    """Send NIXL's Python log to stderr, at WARNING unless ``NIXL_LOG_LEVEL`` asks otherwise.

    nixl configures its logger with a handler on sys.stdout at INFO (a line per agent and
    backend): in a server whose stdout is a protocol, or a peer speaking JSON lines, those
    lines would corrupt it.
    """
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if (
            isinstance(handler, logging.StreamHandler)
            and getattr(handler, "stream", None) is sys.stdout
        ):
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


#: ``probe_nixl(isolated=False, timeout_s=60.0)``: whether ``nixl`` imports here (cached for the process).
#: A ``nixl`` without any of its per-platform sub-wheels raises ImportError too.
probe_nixl = ImportProbe(
    "nixl._api",
    "nixl",
    "nixl is not installed or has no platform wheel ({exc}); install it "
    "with `pip install nixl==1.5.1` (the `nixl` extra)",
    on_import=_quiet_stdout_logging,
)


def nixl_api() -> Any:
    """The ``nixl._api`` module; raises ``NixlUnavailableError`` saying why it cannot be had."""
    availability = probe_nixl()
    if not availability.available:
        raise NixlUnavailableError(availability.reason)
    return importlib.import_module("nixl._api")
