"""Transfer engines behind one interface (``interface.py``): mori.io (``mori.py``), NIXL (``nixl/``), same host
(``same_host/``) and a loopback stand-in (``loopback/``), with the poller that turns their completions into events.

Rules, mori.io's: posting never blocks, bad argument values come back as already-failed statuses, a status is
final once it succeeded or failed; mori.io and nixl are imported only on demand.
"""

from .faults import HeldTransfers, LoopbackFaults, PostedTransfer
from .interface import EngineDescriptor, MemoryDescriptor, TransferEngine, TransferSession
from .loopback import LoopbackEngine, LoopbackEngineDesc, LoopbackMemoryDesc, LoopbackSession
from .mori import MoriAvailability, MoriEngine, MoriSession, MoriUnavailableError, probe_mori
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
