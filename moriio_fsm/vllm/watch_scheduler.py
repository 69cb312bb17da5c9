"""The watch on vLLM's scheduler side: the hook calls (with what the inner connector answered)
become events of the D and P watch machines; their effects are notes, never actions.

Rules: nothing here keeps a transfer's lifecycle; the machines do (``watch_consumer``,
``watch_producer``). What lives here is naming (request id -> transfer key, bounded) and
the loads allocated since the last step was built (drained by that step). Every hook is
guarded: whatever the watch does with a hostile request, vLLM's call goes on unchanged.
A timer thread fires the machines' deadlines while vLLM is idle.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..logs import get_logger
from ..machines import build_table
from ..runtime.declared import events
from ..runtime.driver import Driver
from .ticker import Ticker
from .watch_anomalies import AnomalyLog
from .watch_config import WatchSettings
from .watch_keys import RequestKeys, consumer_key, producer_key, wants_send
from .watch_metrics import WatchMetrics

log = get_logger("moriio_fsm.vllm.watch")

ROLES = {"consumer": "watch_consumer", "producer": "watch_producer"}
MAX_PENDING_STEPS = 1 << 14


def _block_ids(blocks: Any) -> list[int]:
    """The first group's block ids of vLLM's ``KVCacheBlocks`` (empty if it has none)."""
    try:
        groups = blocks.get_block_ids()
        return [int(b) for b in groups[0]] if groups else []
    except Exception:
        return []


class SchedulerWatch:
    """The D and P watch machines of one scheduler, driven by its hook calls."""

    def __init__(
        self,
        settings: WatchSettings,
        recorder: Any,
        side: str,
        clock=time.monotonic,
        spans: Any = None,
    ):
        self.clock = clock
        self.recorder = recorder
        self.spans = spans  # ``TransferSpans`` when OpenTelemetry is on
        self.metrics = WatchMetrics()
        self.keys = RequestKeys()
        self.anomalies = AnomalyLog(side, recorder, self.metrics, self.keys.request_of)
        self.tables = {
            role: build_table(
                name,
                config=settings.machine_config(name),
                recorder=recorder if spans is None else spans.around(recorder),
            )
            for role, name in ROLES.items()
        }
        self.drivers = {
            role: Driver(table, self._handlers(role), clock=clock)
            for role, table in self.tables.items()
        }
        self._allocated: list[str] = []
        self._lock = threading.Lock()
        self._ticker = Ticker(self.drivers, self._settled, settings.tick_interval)

    def _handlers(self, role: str) -> dict:
        def note(effect) -> None:
            self.anomalies.note(
                role, effect.transfer_id, effect.anomaly, effect.detail, self.clock()
            )

        def ended(effect) -> None:
            self.metrics.transfer_ended(role, effect.outcome, effect.transfer_id)

        return {"note_anomaly": note, "transfer_ended": ended}

    # -- dispatching --------------------------------------------------------------------

    def _dispatch(self, role: str, ev: Any) -> Any:
        done = self.drivers[role].dispatch(ev)
        self._settled(role, done)
        return done[0][1] if done else None

    def _settled(self, role: str, done: list) -> None:
        machine = ROLES[role]
        for ev, result in done:
            self.metrics.observe(machine, ev, result)

    def _report(self, role: str, ev: Any) -> None:
        result = self._dispatch(role, ev)
        if result is not None:
            self.anomalies.note_report(role, ev, result)

    def _bind(self, request: Any, key: str) -> None:
        """``request``'s id names ``key`` from now; its trace context parents the spans."""
        self.keys.bind(request.request_id, key)
        if self.spans is not None:
            self.spans.link(key, request.request_id, getattr(request, "trace_headers", None))

    def _live(self, role: str, key: str) -> bool:
        return self.tables[role].state_of(key) is not None

    # -- hooks (each called after the inner connector answered) ----------------------------

    def matched(self, request: Any, answer: Any) -> None:
        count, load_async = answer if isinstance(answer, tuple) and len(answer) == 2 else (0, 0)
        now = self.clock()
        if load_async is True and isinstance(count, int) and count > 0:
            key = consumer_key(request)
            self._bind(request, key)
            self._dispatch("consumer", events.load_requested(key, now, num_tokens=count))
        elif wants_send(request):
            key = producer_key(request)
            self._bind(request, key)
            self._dispatch("producer", events.send_requested(key, now))

    def allocated(self, request: Any, blocks: Any, num_external_tokens: Any) -> None:
        key = self.keys.key_of(request.request_id)
        if not self._live("consumer", key):
            return
        loads = isinstance(num_external_tokens, int) and num_external_tokens > 0
        block_ids = _block_ids(blocks) if loads else []
        self._dispatch("consumer", events.load_allocated(key, self.clock(), block_ids=block_ids))
        if block_ids:
            with self._lock:
                if len(self._allocated) < MAX_PENDING_STEPS:
                    self._allocated.append(key)

    def step_built(self) -> None:
        with self._lock:
            keys, self._allocated = self._allocated, []
        now = self.clock()
        for key in keys:
            self._dispatch("consumer", events.load_step(key, now))

    def finished(self, request: Any, answer: Any) -> None:
        key, now = self.keys.key_of(request.request_id), self.clock()
        if self._live("consumer", key):
            self._dispatch("consumer", events.request_ended(key, now))
        held = isinstance(answer, tuple) and len(answer) == 2 and answer[0] is True
        if self._live("producer", key):
            self._dispatch("producer", events.prefill_ended(key, now, held=held))
        elif held and wants_send(request):
            # No earlier hook saw the request (a connector that never matched it): it is
            # held now, so it is watched from now.
            key = producer_key(request)
            self._bind(request, key)
            self._dispatch("producer", events.send_requested(key, now))
            self._dispatch("producer", events.prefill_ended(key, now, held=True))

    def output(self, connector_output: Any) -> None:
        """The workers' reports, as vLLM aggregated them for the scheduler."""
        now = self.clock()
        for rid in _ids(getattr(connector_output, "failed_recving", None)):
            self._report("consumer", events.recv_failed(self.keys.key_of(rid), now))
        invalid = _ids(getattr(connector_output, "invalid_block_ids", None))
        if invalid:
            failed = sorted(b for b in invalid if isinstance(b, int))
            for key in self.tables["consumer"].live_ids():
                self._dispatch("consumer", events.blocks_failed(key, now, block_ids=failed))
        for rid in _ids(getattr(connector_output, "finished_recving", None)):
            self._report("consumer", events.recv_reported(self.keys.key_of(rid), now))
        for rid in _ids(getattr(connector_output, "finished_sending", None)):
            self._report("producer", events.send_reported(self.keys.key_of(rid), now))

    def close(self) -> None:
        self._ticker.stop()


def _ids(value: Any) -> list:
    if not value:
        return []
    try:
        return list(value)
    except TypeError:
        return []
