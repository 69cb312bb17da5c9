"""The engines' former import path, which the README names: a re-export of ``moriio_fsm.engines``.

Rules: nothing is defined here; new code imports from ``moriio_fsm.engines``.
"""

from ...engines import (
                        CompletionPoller,
                        EngineDescriptor,
                        HeldTransfers,
                        LoopbackEngine,
                        LoopbackEngineDesc,
                        LoopbackFaults,
                        LoopbackMemoryDesc,
                        LoopbackSession,
                        MemoryDescriptor,
                        MoriAvailability,
                        MoriEngine,
                        MoriSession,
                        MoriUnavailableError,
                        PostedTransfer,
                        StatusCode,
                        TransferEngine,
                        TransferSession,
                        TransferStatus,
                        probe_mori,
                        wait_all,
)

__all__ = ["CompletionPoller", "EngineDescriptor", "HeldTransfers", "LoopbackEngine", "LoopbackEngineDesc",
           "LoopbackFaults", "LoopbackMemoryDesc", "LoopbackSession", "MemoryDescriptor", "MoriAvailability",
           "MoriEngine", "MoriSession", "MoriUnavailableError", "PostedTransfer", "StatusCode", "TransferEngine",
           "TransferSession", "TransferStatus", "probe_mori", "wait_all"]
