"""A STAND-IN for mori's native module ``mori.cpp``, under the real amd-mori wheel's own Python layer: MoriEngine
runs through ``mori.io`` on hosts without AMD hardware (tests, benchmarks).

Rules: nothing is loaded until ``load_mori_io()`` is called, and never over a mori that imports for real; the
stand-in is written from mori's pybind11 definitions (as strict about arguments, with mori's status codes and
rules), moves real bytes between registered host tensors on its own threads (memmove within a process; over TCP
to the listener an RDMA engine opens on its host:port, ``nic.py``, between processes and hosts), and injects
failures (``FAULTS``, or ``MORI_STANDIN_FAULTS`` in the environment) with mori's error codes; what native mori would do undefined (writing into a freed status) is
recorded as an incident (``incidents.take()``), never hidden.
"""

from . import incidents
from .engine import FAULTS, HOST
from .faults import Faults, Gate
from .loader import StandInRefused, is_loaded, load_mori_io, unload
from .module import NATIVE_NAMES
from .registry import with_key as engines_named
from .transfers import drain
from .wheel import (
    PINNED_VERSION,
    WheelMismatch,
    WheelUnavailable,
    cache_root,
    fetch_wheel,
    python_layer,
)

__all__ = [
    "FAULTS",
    "Faults",
    "Gate",
    "HOST",
    "NATIVE_NAMES",
    "PINNED_VERSION",
    "StandInRefused",
    "WheelMismatch",
    "WheelUnavailable",
    "cache_root",
    "drain",
    "engines_named",
    "fetch_wheel",
    "incidents",
    "is_loaded",
    "load_mori_io",
    "python_layer",
    "unload",
]
