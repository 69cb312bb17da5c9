"""The chaos run: the whole stack (machines, drivers, wire codec, loopback engines, pollers)
under every fault at once, seeded, judged by a block ledger.

``run_chaos(ChaosSettings(transfers=..., seed=..., fault_rate=...))`` returns a
``ChaosResult``; its ``line()`` is what ``moriio-fsm chaos`` prints last. ``run.py``
says how a run goes, ``ledger.py`` what it judges.
"""

from .run import ChaosResult, run_chaos
from .settings import ChaosSettings, ChaosUsageError

__all__ = ["ChaosResult", "ChaosSettings", "ChaosUsageError", "run_chaos"]
