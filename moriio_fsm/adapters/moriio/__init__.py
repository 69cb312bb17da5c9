"""Transfer engines: the mori.io binding, a loopback stand-in and the completion poller.

The state machines post RDMA writes and reads through ``TransferEngine`` and learn of
their completion from ``CompletionPoller`` events. Every engine keeps mori.io's rules:
posting never blocks, bad argument values come back as already-failed statuses, and a
status is final once it succeeded or failed. mori.io itself is imported only on demand.
"""

from .engine import EngineDescriptor, MemoryDescriptor, TransferEngine, TransferSession
from .faults import HeldTransfers, LoopbackFaults, PostedTransfer
from .loopback import LoopbackEngine, LoopbackEngineDesc, LoopbackMemoryDesc, LoopbackSession
from .mori_engine import MoriAvailability, MoriEngine, MoriSession, MoriUnavailableError, probe_mori
from .poller import CompletionPoller
from .status import StatusCode, TransferStatus, wait_all

__all__ = [
    "EngineDescriptor",
    "MemoryDescriptor",
    "TransferEngine",
    "TransferSession",
    "TransferStatus",
    "StatusCode",
    "wait_all",
    "LoopbackEngine",
    "LoopbackEngineDesc",
    "LoopbackFaults",
    "HeldTransfers",
    "LoopbackMemoryDesc",
    "LoopbackSession",
    "PostedTransfer",
    "MoriAvailability",
    "MoriEngine",
    "MoriSession",
    "MoriUnavailableError",
    "probe_mori",
    "CompletionPoller",
]
