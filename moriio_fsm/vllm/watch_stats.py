"""vLLM's stats and Prometheus metrics of a watched connector: the inner connector's, unchanged,
beside the watch's own.

Rules: the data vLLM moves between processes is ``{"inner": <the inner connector's stats
data or None>, "inner_class": [name, module path], "watch": <WatchMetrics data>}``; the
inner connector's part is rebuilt, aggregated, reduced and observed by its own classes, so
its log line and metrics are what they are unwatched. The watch's metrics have fixed names:
``vllm:moriio_fsm_watch_transfers_total{role,outcome}``,
``vllm:moriio_fsm_watch_anomalies_total{kind}``, ``vllm:moriio_fsm_watch_stuck_transfers``
and ``vllm:moriio_fsm_watch_state_seconds{state}``.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .watch_metrics import empty_watch_data, merge_watch_data

STATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 120.0, 600.0)


@functools.lru_cache(maxsize=16)
def class_by_name(name: str, module: str | None) -> Any:
    """The inner connector's class from its name and module path (None if it cannot load)."""
    try:
        if module:
            return getattr(importlib.import_module(module), name)
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        return KVConnectorFactory.get_connector_class_by_name(name)
    except Exception:
        return None


def _inner_stats(data: dict[str, Any]) -> KVConnectorStats | None:
    inner = data.get("inner")
    named = data.get("inner_class") or ("", None)
    if inner is None:
        return None
    cls = class_by_name(str(named[0]), named[1])
    return None if cls is None else cls.build_kv_connector_stats(data=inner)


@dataclass
class WatchStats(KVConnectorStats):
    """The inner connector's stats and the watch's, side by side."""

    def __post_init__(self) -> None:
        if not self.data:
            self.data = {"inner": None, "inner_class": ["", None], "watch": empty_watch_data()}
        self.data.setdefault("watch", empty_watch_data())
        self.data.setdefault("inner", None)
        self.data.setdefault("inner_class", ["", None])

    def reset(self) -> None:
        inner = _inner_stats(self.data)
        if inner is not None:
            inner.reset()
            self.data["inner"] = inner.data
        self.data["watch"] = empty_watch_data()

    def aggregate(self, other: KVConnectorStats) -> WatchStats:
        theirs = other.data or {}
        mine_inner, their_inner = _inner_stats(self.data), _inner_stats(theirs)
        if mine_inner is None:
            self.data["inner"] = theirs.get("inner")
            self.data["inner_class"] = theirs.get("inner_class", self.data["inner_class"])
        elif their_inner is not None:
            self.data["inner"] = mine_inner.aggregate(their_inner).data
        self.data["watch"] = merge_watch_data(self.data["watch"], theirs.get("watch") or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        inner = _inner_stats(self.data)
        out: dict[str, Any] = dict(inner.reduce()) if inner is not None else {}
        watch = self.data["watch"]
        for name, count in sorted(watch.get("transfers", {}).items()):
            out[f"watch_transfers_{name.replace('|', '_')}"] = count
        for kind, count in sorted(watch.get("anomalies", {}).items()):
            out[f"watch_anomalies_{kind}"] = count
        out["watch_stuck_transfers"] = watch.get("stuck", 0)
        return out

    def is_empty(self) -> bool:
        inner = _inner_stats(self.data)
        watch = self.data["watch"]
        return (inner is None or inner.is_empty()) and not (
            watch.get("transfers")
            or watch.get("anomalies")
            or watch.get("stuck")
            or watch.get("state_s")
        )


class WatchPromMetrics(KVConnectorPromMetrics):
    """The inner connector's Prometheus metrics, fed its own data, and the watch's."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues, inner):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._inner = inner
        self._transfers = self._counter_cls(
            name="vllm:moriio_fsm_watch_transfers",
            documentation="Watched transfers ended, by side (role) and outcome.",
            labelnames=labelnames + ["role", "outcome"],
        )
        self._anomalies = self._counter_cls(
            name="vllm:moriio_fsm_watch_anomalies",
            documentation="Anomalies the watch noted, by kind.",
            labelnames=labelnames + ["kind"],
        )
        self._stuck = self._gauge_cls(
            name="vllm:moriio_fsm_watch_stuck_transfers",
            documentation="Live watched transfers past their deadline now.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._state_s = self._histogram_cls(
            name="vllm:moriio_fsm_watch_state_seconds",
            documentation="Time watched transfers spent in each observed state.",
            buckets=list(STATE_BUCKETS),
            labelnames=labelnames + ["state"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        if self._inner is not None and data.get("inner") is not None:
            self._inner.observe(data["inner"], engine_idx)
        labels = list(self.per_engine_labelvalues.get(engine_idx, []))
        watch = data.get("watch") or {}
        for name, count in watch.get("transfers", {}).items():
            role, _, outcome = name.partition("|")
            self._transfers.labels(*labels, role, outcome).inc(count)
        for kind, count in watch.get("anomalies", {}).items():
            self._anomalies.labels(*labels, kind).inc(count)
        self._stuck.labels(*labels).set(watch.get("stuck", 0))
        for state, samples in watch.get("state_s", {}).items():
            child = self._state_s.labels(*labels, state)
            for value in samples:
                child.observe(value)
