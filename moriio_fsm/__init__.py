"""moriio-fsm: the KV-cache transfer lifecycle of P/D serving as declarative state machines.

The names most programs need are here: ``build_table`` (a machine's transfer table),
``events`` and ``emits`` (the declared event and effect kinds), ``Driver`` (runs the
effects), ``Outcome`` and the root error ``MoriioFsmError``.
"""

import logging

from .errors import MoriioFsmError
from .machines import build_machine, build_table
from .runtime.declared import emits, events
from .runtime.driver import Driver
from .runtime.events import Effect, Event, Outcome

__version__ = "0.1.0"

# A library prints nothing unless the application configures logging: without this,
# Python's last-resort handler would write the package's warnings to stderr.
logging.getLogger("moriio_fsm").addHandler(logging.NullHandler())

__all__ = [
    "Driver",
    "Effect",
    "Event",
    "MoriioFsmError",
    "Outcome",
    "build_machine",
    "build_table",
    "emits",
    "events",
]
