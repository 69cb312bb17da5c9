"""vLLM-native metrics of the connector: what every transfer's machine did, per interval.

The worker folds each dispatch result into ``TransferMetrics`` (state entry times,
ended transfers by outcome, events by outcome, bytes posted); ``snapshot()`` hands vLLM
the interval's plain-data dict and starts a new interval. ``FsmConnectorStats`` is the
``KVConnectorStats`` vLLM aggregates and logs; ``FsmPromMetrics`` feeds Prometheus under
``vllm:moriio_fsm_*``. Memory is bounded: per-transfer entries live while it does.
Two threads' results for one transfer may be folded in either order: a step that comes
after the transfer's end was folded in (its creation, say) changes nothing.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: How an ended transfer is counted, by its final state (anomaly states: "anomaly").
OUTCOME_OF_STATE = {
    "failed": "failed",
    "abandoned": "failed",
    "expired": "expired",
    "aborted": "aborted",
}
OUTCOMES = ("completed", "failed", "expired", "aborted", "anomaly")
EVENT_OUTCOMES = (
    "late",
    "duplicate",
    "rejected",
    "dropped",
    "unknown",
    "buffered",
    "ignored",
    "forged",
)
MAX_SAMPLES = 4096  # per interval and list: a busy interval keeps the first ones
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
BYTE_BUCKETS = tuple(float(1 << p) for p in range(10, 34, 2))


@dataclass
class _Live:
    state: str
    entered: float
    started: float


class TransferMetrics:
    """Collects one interval of observations from dispatch results (thread-safe)."""

    def __init__(self, specs: dict[str, Any], max_live: int = 1 << 16):
        self._anomaly = {
            side: {n for n, s in spec.states.items() if s.anomaly} for side, spec in specs.items()
        }
        self._final = {side: set(spec.final_states) for side, spec in specs.items()}
        self._machine = {side: spec.name for side, spec in specs.items()}
        self._max_live = max_live
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._ended_ids: OrderedDict[str, None] = OrderedDict()  # the newest max_live
        self._new_interval()

    def _new_interval(self) -> None:
        self._ended: Counter = Counter()
        self._events: Counter = Counter()
        self._transfer_time: list[float] = []
        self._bytes: list[int] = []
        self._state_time: dict[str, list[float]] = {}
        self._rejected_messages = 0

    def observe(self, side: str, ev: Any, result: Any, now: float) -> None:
        outcome = result.outcome.value
        with self._lock:
            if outcome in EVENT_OUTCOMES:
                self._events[outcome] += 1
            if result.hops is None:
                return
            tid = ev.transfer_id
            live = self._live.get(tid)
            if live is None:
                if len(self._live) >= self._max_live or tid in self._ended_ids:
                    return
                live = self._live[tid] = _Live(result.hops[0][0], now, now)
            for _before, after in result.hops:
                times = self._state_time.setdefault(f"{self._machine[side]}.{live.state}", [])
                if len(times) < MAX_SAMPLES:
                    times.append(now - live.entered)
                live.state, live.entered = after, now
            if live.state in self._final[side]:
                del self._live[tid]
                self._ended_ids[tid] = None
                if len(self._ended_ids) > self._max_live:
                    self._ended_ids.popitem(last=False)
                state = live.state
                kind = (
                    "anomaly"
                    if state in self._anomaly[side]
                    else OUTCOME_OF_STATE.get(state, "completed")
                )
                self._ended[kind] += 1
                if kind == "completed" and len(self._transfer_time) < MAX_SAMPLES:
                    self._transfer_time.append(now - live.started)

    def add_bytes(self, count: int) -> None:
        with self._lock:
            if len(self._bytes) < MAX_SAMPLES:
                self._bytes.append(count)

    def add_rejected_messages(self, count: int) -> None:
        with self._lock:
            self._rejected_messages += count

    def snapshot(self) -> dict[str, Any]:
        """The interval's plain data (vLLM pickles it across processes); a new interval starts."""
        with self._lock:
            data = {
                "transfers": dict(self._ended),
                "events": dict(self._events),
                "transfer_time_s": self._transfer_time,
                "bytes": self._bytes,
                "state_time_s": self._state_time,
                "rejected_messages": self._rejected_messages,
                "live": len(self._live),
            }
            self._new_interval()
        return data


def _empty() -> dict[str, Any]:
    return {
        "transfers": {},
        "events": {},
        "transfer_time_s": [],
        "bytes": [],
        "state_time_s": {},
        "rejected_messages": 0,
        "live": 0,
    }


@dataclass
class FsmConnectorStats(KVConnectorStats):
    """The connector's ``KVConnectorStats``: counters add up, samples concatenate."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> FsmConnectorStats:
        mine, theirs = self.data, (other.data or _empty())
        for key in ("transfers", "events"):
            merged = Counter(mine.get(key, {}))
            merged.update(theirs.get(key, {}))
            mine[key] = dict(merged)
        for key in ("transfer_time_s", "bytes"):
            mine[key] = (list(mine.get(key, [])) + list(theirs.get(key, [])))[: 4 * MAX_SAMPLES]
        states = {k: list(v) for k, v in mine.get("state_time_s", {}).items()}
        for state, samples in theirs.get("state_time_s", {}).items():
            states.setdefault(state, []).extend(samples)
        mine["state_time_s"] = states
        mine["rejected_messages"] = mine.get("rejected_messages", 0) + theirs.get(
            "rejected_messages", 0
        )
        mine["live"] = max(mine.get("live", 0), theirs.get("live", 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self.data
        times = sorted(data.get("transfer_time_s", []))
        out: dict[str, int | float] = {
            f"transfers_{k}": data.get("transfers", {}).get(k, 0) for k in OUTCOMES
        }
        out.update({f"events_{k}": v for k, v in sorted(data.get("events", {}).items())})
        if times:
            out["transfer_time_p50_ms"] = round(1000 * times[len(times) // 2], 3)
            out["transfer_time_max_ms"] = round(1000 * times[-1], 3)
        out["bytes"] = sum(data.get("bytes", []))
        out["rejected_messages"] = data.get("rejected_messages", 0)
        out["live_transfers"] = data.get("live", 0)
        return out

    def is_empty(self) -> bool:
        data = self.data
        return not (
            data.get("transfers")
            or data.get("events")
            or data.get("bytes")
            or data.get("rejected_messages")
            or data.get("state_time_s")
        )


class FsmPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics under ``vllm:moriio_fsm_*``, one child per engine (and label)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._transfers = self._counter_cls(
            name="vllm:moriio_fsm_transfers",
            documentation="Transfers ended, by outcome.",
            labelnames=labelnames + ["outcome"],
        )
        self._events = self._counter_cls(
            name="vllm:moriio_fsm_events",
            documentation="Events that did not advance a "
            "transfer, by outcome (late, duplicate, rejected, dropped, ...).",
            labelnames=labelnames + ["outcome"],
        )
        self._rejected = self._counter_cls(
            name="vllm:moriio_fsm_rejected_messages",
            documentation="Control messages the listener refused.",
            labelnames=labelnames,
        )
        self._transfer_time = self._histogram_cls(
            name="vllm:moriio_fsm_transfer_time_seconds",
            documentation="Time from a transfer's start to its completion.",
            buckets=list(TIME_BUCKETS),
            labelnames=labelnames,
        )
        self._bytes = self._histogram_cls(
            name="vllm:moriio_fsm_transfer_bytes",
            documentation="Bytes posted per layer batch.",
            buckets=list(BYTE_BUCKETS),
            labelnames=labelnames,
        )
        self._state_time = self._histogram_cls(
            name="vllm:moriio_fsm_state_time_seconds",
            documentation="Time transfers spent in each machine state.",
            buckets=list(TIME_BUCKETS),
            labelnames=labelnames + ["state"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues.get(engine_idx, []))
        data = transfer_stats_data or {}
        for outcome, count in data.get("transfers", {}).items():
            self._transfers.labels(*labels, outcome).inc(count)
        for outcome, count in data.get("events", {}).items():
            self._events.labels(*labels, outcome).inc(count)
        if data.get("rejected_messages"):
            self._rejected.labels(*labels).inc(data["rejected_messages"])
        for value in data.get("transfer_time_s", []):
            self._transfer_time.labels(*labels).observe(value)
        for value in data.get("bytes", []):
            self._bytes.labels(*labels).observe(value)
        for state, values in data.get("state_time_s", {}).items():
            child = self._state_time.labels(*labels, state)
            for value in values:
                child.observe(value)
