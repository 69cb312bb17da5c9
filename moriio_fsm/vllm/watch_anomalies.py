"""The watch's anomalies: each counted, logged once with its request, its transfer key and the
path of states it took (with the time in each), read from the trace.

Rules: the machines decide what is an anomaly (``note_anomaly`` effects); a report for a
transfer the tables do not know (outcome ``unknown``) or that ended (``late``) is one too,
decided by the table. Logging is rate-limited (the first ``LOG_FIRST`` of each kind, then
every ``LOG_EVERY``-th), counting is not: a flood of junk reports cannot flood the log.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ..logs import get_logger
from ..runtime.events import Outcome
from .watch_metrics import WatchMetrics

log = get_logger("moriio_fsm.vllm.watch")

LOG_FIRST = 20
LOG_EVERY = 1000
_UNEXPECTED = {Outcome.UNKNOWN: "unknown", Outcome.LATE: "ended"}


def state_path(steps: list[Any], now: float) -> str:
    """``state 0.001s -> state 2.500s -> ...`` from a transfer's trace records."""
    path: list[tuple[str, float]] = []
    for step in steps:
        after = step.after
        if after is not None and (not path or path[-1][0] != after):
            path.append((after, step.t))
    parts = []
    for index, (state, since) in enumerate(path):
        until = path[index + 1][1] if index + 1 < len(path) else now
        parts.append(f"{state} {max(0.0, until - since):.3f}s")
    return " -> ".join(parts) or "(no trace)"


class AnomalyLog:
    """Counts and logs the anomalies of one side's watch machines."""

    def __init__(self, side: str, recorder: Any, metrics: WatchMetrics, request_of):
        self._side = side
        self._recorder = recorder
        self._metrics = metrics
        self._request_of = request_of
        self._lock = threading.Lock()
        self.counts: Counter = Counter()

    def note(self, role: str, key: str, kind: str, detail: str, now: float) -> None:
        """Count one anomaly of transfer ``key`` and log it (rate-limited by kind)."""
        self._metrics.anomaly(kind, role, key)
        with self._lock:
            self.counts[kind] += 1
            seen = self.counts[kind]
        if seen > LOG_FIRST and seen % LOG_EVERY:
            return
        steps = self._recorder.records(key) if self._recorder is not None else []
        log.warning(
            "watch.anomaly",
            kind=kind,
            side=self._side,
            role=role,
            request_id=self._request_of(key),
            transfer=key,
            detail=detail,
            path=state_path(steps, now),
            seen=seen,
        )

    def note_report(self, role: str, ev: Any, result: Any) -> None:
        """A finished report the table did not know or that came after the transfer ended."""
        why = _UNEXPECTED.get(result.outcome)
        if why is None:
            return
        detail = f"{ev.kind} for a transfer that is {why}"
        self.note(role, ev.transfer_id, "unexpected_report", detail, ev.time)
