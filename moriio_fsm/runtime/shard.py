"""One shard of a transfer table: the transfers one lock guards.

Rules: every field is read and written only with ``lock`` held (a step, its record, a
timer's firing); counters are a list indexed by ``Outcome.index``, so counting hashes
nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from .early_facts import EarlyFacts
from .events import Outcome


class Shard:
    """One lock's worth of a table: its live transfers, ended ids, held facts, counters."""

    __slots__ = ("lock", "live", "ended", "early", "counts", "ended_in", "fired")

    def __init__(self, early: EarlyFacts) -> None:
        self.lock = threading.Lock()
        self.live: dict[str, Any] = {}
        self.ended: dict[str, str] = {}  # insertion-ordered: oldest first
        self.early = early
        self.counts = [0] * len(Outcome)  # indexed by Outcome.index
        self.ended_in: dict[str, int] = {}  # final state -> transfers that ended there
        # Trace mode: the rows the running step took (None with the transitions executor,
        # whose steps do not say).
        self.fired: tuple[int, ...] | None = ()

    def holds(self, tx: Any) -> bool:
        """Whether ``tx`` is the live record of its transfer (not retired, not replaced)."""
        return self.live.get(tx.transfer_id) is tx
