"""The stand-in ``mori.cpp`` module: every name mori 1.2.4's native module binds for ``mori.io``.

Rules: the module says it is a stand-in (``__standin__``, its docstring, every object's repr); it holds the 15 names
``mori/io/__init__.py`` imports, ``TransferStatus``, ``IOEngine`` and ``IOEngineSession``, and the enum members
``export_values()`` puts at module level; functions mori binds for GPU fabric memory raise, as there is none.
"""

from __future__ import annotations

import logging
import types

from .binding import INT, SIZE_T, UINT64, Param, signature
from .codes import (
    EXPORTED,
    BackendType,
    MemoryLocationType,
    PeerFailureReason,
    PollCqMode,
    StatusCode,
)
from .descriptors import (
    BackendConfig,
    EngineDesc,
    FabricBackendConfig,
    IOEngineConfig,
    MemoryDesc,
    PeerFailureEvent,
    RdmaBackendConfig,
    XgmiBackendConfig,
)
from .engine import IOEngine
from .session import IOEngineSession
from .transfer_status import TransferStatus

__all__ = ["NATIVE_NAMES", "make_module"]

_log = logging.getLogger("moriio_fsm.engines.mori_standin")


@signature("module", Param(INT), method=False)
def set_log_level(level: int) -> None:
    _log.debug("[mori stand-in] set_log_level(%d)", level)


@signature("module", Param(SIZE_T, "size"), Param(INT, "device"), returns="int", method=False)
def fabric_alloc(size: int, device: int) -> int:
    raise RuntimeError(
        "stand-in: fabric_alloc needs GPU memory on a scale-up fabric; this host has none"
    )


@signature("module", Param(UINT64, "ptr"), method=False)
def fabric_free(ptr: int) -> None:
    raise RuntimeError("stand-in: fabric_free: nothing was allocated on a fabric")


_OBJECTS = {
    "set_log_level": set_log_level,
    "fabric_alloc": fabric_alloc,
    "fabric_free": fabric_free,
    "BackendType": BackendType,
    "MemoryLocationType": MemoryLocationType,
    "StatusCode": StatusCode,
    "PollCqMode": PollCqMode,
    "PeerFailureReason": PeerFailureReason,
    "BackendConfig": BackendConfig,
    "RdmaBackendConfig": RdmaBackendConfig,
    "XgmiBackendConfig": XgmiBackendConfig,
    "FabricBackendConfig": FabricBackendConfig,
    "IOEngineConfig": IOEngineConfig,
    "TransferStatus": TransferStatus,
    "EngineDesc": EngineDesc,
    "MemoryDesc": MemoryDesc,
    "PeerFailureEvent": PeerFailureEvent,
    "IOEngineSession": IOEngineSession,
    "IOEngine": IOEngine,
}

#: The names the module binds (enum members exported at module level aside).
NATIVE_NAMES = frozenset(_OBJECTS)


def make_module() -> types.ModuleType:
    """A fresh ``mori.cpp`` stand-in module object (the classes behind it are shared)."""
    module = types.ModuleType(
        "mori.cpp",
        "STAND-IN for mori's native module (moriio_fsm.engines.mori_standin): "
        "host memory only, not AMD's mori",
    )
    for name, value in EXPORTED.items():
        setattr(module, name, value)
    for name, value in _OBJECTS.items():
        setattr(module, name, value)
    module.__standin__ = True  # type: ignore[attr-defined]
    return module
