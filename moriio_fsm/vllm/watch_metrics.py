"""What the watch counts, per interval: transfers ended, anomalies, stuck transfers, state times.

Rules: fed only from the watch machines' results and effects (hops, ``transfer_ended``,
``note_anomaly``); thread-safe; memory is bounded (per-transfer entries live while the
transfer does, samples are capped per interval). ``snapshot()`` hands vLLM the interval's
plain data and starts a new interval; the stuck gauge is a level, not reset.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

#: The anomaly kinds the watch reports (the metric's ``kind`` label).
ANOMALY_KINDS = ("stuck_load", "stranded_kv", "unexpected_report", "second_report", "load_error")
#: Anomalies that mean a live transfer is past its deadline (the stuck gauge).
DEADLINE_KINDS = frozenset({"stuck_load", "stranded_kv"})
MAX_SAMPLES = 4096
MAX_LIVE = 1 << 16


class WatchMetrics:
    """Collects one interval of the watch's observations (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entered: dict[tuple[str, str], tuple[str, float]] = {}
        self._stuck: set[str] = set()
        self._new_interval()

    def _new_interval(self) -> None:
        self._transfers: Counter = Counter()
        self._anomalies: Counter = Counter()
        self._state_s: dict[str, list[float]] = {}

    def observe(self, machine: str, ev: Any, result: Any) -> None:
        """Time spent in each state a step left (from the events' own clock)."""
        hops = result.hops
        if hops is None:
            return
        key = (machine, ev.transfer_id)
        now = ev.time
        with self._lock:
            entered = self._entered.get(key)
            if entered is None and len(self._entered) >= MAX_LIVE:
                return
            state, since = entered if entered is not None else (hops[0][0], now)
            for _before, after in hops:
                samples = self._state_s.setdefault(f"{machine}.{state}", [])
                if len(samples) < MAX_SAMPLES:
                    samples.append(max(0.0, now - since))
                state, since = after, now
            if result.state is None or result.state in ("released", "freed", "closed"):
                self._entered.pop(key, None)
            else:
                self._entered[key] = (state, since)

    def transfer_ended(self, role: str, outcome: str, key: str) -> None:
        with self._lock:
            self._transfers[f"{role}|{outcome}"] += 1
            self._stuck.discard(f"{role}|{key}")

    def anomaly(self, kind: str, role: str = "", key: str = "") -> None:
        with self._lock:
            self._anomalies[kind] += 1
            if kind in DEADLINE_KINDS:
                self._stuck.add(f"{role}|{key}")

    def stuck_now(self) -> int:
        with self._lock:
            return len(self._stuck)

    def snapshot(self) -> dict[str, Any]:
        """The interval's plain data (crosses processes); a new interval starts."""
        with self._lock:
            data = {
                "transfers": dict(self._transfers),
                "anomalies": dict(self._anomalies),
                "stuck": len(self._stuck),
                "state_s": self._state_s,
            }
            self._new_interval()
        return data


def empty_watch_data() -> dict[str, Any]:
    return {"transfers": {}, "anomalies": {}, "stuck": 0, "state_s": {}}


def merge_watch_data(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Counters add up, samples concatenate (capped), the gauge takes the larger level."""
    out = empty_watch_data()
    for key in ("transfers", "anomalies"):
        merged = Counter(mine.get(key, {}))
        merged.update(theirs.get(key, {}))
        out[key] = dict(merged)
    states = {k: list(v) for k, v in mine.get("state_s", {}).items()}
    for state, samples in theirs.get("state_s", {}).items():
        states[state] = (states.get(state, []) + list(samples))[: 4 * MAX_SAMPLES]
    out["state_s"] = states
    out["stuck"] = max(int(mine.get("stuck", 0)), int(theirs.get("stuck", 0)))
    return out
