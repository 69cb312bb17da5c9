"""Transfer engines: the mori.io binding, a loopback stand-in and the completion poller."""

from .engine import EngineDescriptor, MemoryDescriptor, TransferEngine, TransferSession
from .mori_engine import MoriAvailability, MoriEngine, MoriUnavailableError, probe_mori
from .poller import CompletionPoller
from .loopback import LoopbackEngine, LoopbackFaults, LoopbackSession, PostedTransfer
from .status import StatusCode, TransferStatus, wait_all

__all__ = [
    "EngineDescriptor",
    "MemoryDescriptor",
    "TransferEngine",
    "TransferSession",
    "MoriAvailability",
    "MoriEngine",
    "MoriUnavailableError",
    "probe_mori",
    "CompletionPoller",
    "LoopbackEngine",
    "LoopbackFaults",
    "LoopbackSession",
    "PostedTransfer",
    "StatusCode",
    "TransferStatus",
    "wait_all",
]
