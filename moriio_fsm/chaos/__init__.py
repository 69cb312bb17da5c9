"""The chaos run: the whole stack (machines, drivers, wire codec, loopback engines, pollers)
under every fault at once, seeded, judged by a block ledger.

``run_chaos(ChaosSettings(transfers=..., seed=..., fault_rate=...))`` returns a
``ChaosResult``; its ``line()`` is what ``moriio-fsm chaos`` prints last. ``run.py``
says how a run goes; ``world.py`` holds what its parts share (the clock, the seed, the
block ledger of ``moriio_fsm.ledger``), ``hosts.py`` starts the transfers, ``ranks.py``
runs the machines, ``wire.py`` carries their messages, ``operations.py`` and
``fabric.py`` their RDMA.
"""

from .run import ChaosResult, run_chaos
from .settings import ChaosSettings, ChaosUsageError

__all__ = ["ChaosResult", "ChaosSettings", "ChaosUsageError", "run_chaos"]
