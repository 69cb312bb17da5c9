"""Transfer engines (mori.io, a loopback stand-in with fault injection) and the poller turning completions into events.

Rules, mori.io's: posting never blocks, bad argument values come back as already-failed statuses, a status is
final once it succeeded or failed; mori.io itself is imported only on demand.
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
