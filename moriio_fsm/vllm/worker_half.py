"""The connector's worker half: vLLM's worker hooks turned into events for this rank's machines.

Every transfer of this rank is one machine, run by a driver. The forward thread dispatches
and posts, never waits for RDMA or a socket; messages (``inbound.py``), completions (the
poller) and timers (``ticker.py``) arrive on their own threads. What the events mean is the
specs' business; the parts this module wires together each do one job: ``transfers.py``
starts and ends transfers, ``posting.py`` posts a dispatch's layers together,
``preparation.py`` prepares writes early, ``step_waits.py`` waits between steps,
``topology.py`` holds the ranks and ports, and effect handlers see only a ``HandlerContext``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..adapters.zmq import Role, TransportConfig, ZmqTransport
from ..adapters.zmq.reporting import LogLimiter
from ..engines.poller import CompletionPoller
from ..layout import LayerKVFormat
from ..machines import build_table
from ..runtime.declared import events
from ..runtime.driver import Driver
from ..runtime.events import Outcome
from . import read_handlers, write_handlers
from .context import HandlerContext
from .directory import TransferDirectory
from .ended_verdicts import EndedVerdicts
from .engine_faults import inject_faults
from .inbound import Inbound
from .kv_cache import LocalKvCache
from .message_faults import MessageFaults, wants_message_faults
from .metadata import StepMetadata
from .metrics import TransferMetrics
from .peer_binding import PeerBinding
from .peers import PeerLinks
from .posting import PostBatcher
from .preparation import WritePreparation
from .reports import VllmReports
from .reused_ids import ReusedIdReplies
from .settings import ConnectorSettings
from .step_waits import wait_between_steps
from .ticker import Ticker
from .topology import Topology
from .trace_setup import make_recorder
from .transfers import TransferStarts

#: Which machine each side runs, by mode.
MACHINES = {
    ("write", "send"): "write_producer",
    ("write", "receive"): "write_consumer",
    ("read", "send"): "read_producer",
    ("read", "receive"): "read_consumer",
}


def handlers_for(machine: str, ctx: HandlerContext) -> dict:
    """The effect handlers of ``machine``, carrying out its effects with ``ctx``."""
    module = write_handlers if machine.startswith("write") else read_handlers
    if machine.endswith("producer"):
        return module.producer_handlers(ctx)
    return module.consumer_handlers(ctx)


class WorkerHalf:
    """One rank's transfers: tables, drivers, transport, engine, poller, reports."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        engine_id: str,
        sides: tuple[str, ...],
        tp_rank: int,
        tp_size: int,
        dp_rank: int,
        make_engine: Callable[[str], Any],
        host: str,
        clock: Callable[[], float] = time.monotonic,
        recorder: Any = None,
    ):
        self.settings = settings
        self.engine_id = engine_id
        self.topology = Topology(tp_rank, tp_size, dp_rank)
        self.host = host
        self.clock = clock
        self._make_engine = make_engine
        self.reports = VllmReports()
        self.directory = TransferDirectory()
        self.handshake_port: int | None = None
        self._closed = False
        self._step_sends: list[str] = []  # P, WRITE: transfers saved by this forward
        self._step_idle = False  # this step runs no forward (StepMetadata.idle)
        # P, WRITE: transfer -> bitmap of the layers this forward scheduled.
        self._saved_this_step: dict[str, int] = {}
        #: Rate-limits the warnings about failed transfers (a storm of them says so once a second).
        self.failure_log = LogLimiter(per_second=20)
        if recorder is None:
            recorder = make_recorder(settings, engine_id, self.topology)
        self.recorder = recorder
        self.spans: Any = None  # ``TransferSpans`` when OpenTelemetry is on
        if settings.otel:
            from ..trace.otel_spans import TransferSpans

            self.spans = TransferSpans(self.topology.label(engine_id))
        self._rejected_seen = 0
        self._build_machines(sides)
        self._build_io(sides)

    def _build_machines(self, sides: tuple[str, ...]) -> None:
        """The tables and drivers of ``sides``, the poller their completions come from, and
        the context their handlers use."""
        names = {side: MACHINES[(self.settings.mode, side)] for side in sides}
        tables = {
            side: build_table(
                name,
                config=self.settings.machine_overrides(name),
                recorder=self.recorder if self.spans is None else self.spans.around(self.recorder),
            )
            for side, name in names.items()
        }
        self._finals = {side: frozenset(table.spec.final_states) for side, table in tables.items()}
        self._anomalies = {
            side: frozenset(table.spec.anomaly_states) for side, table in tables.items()
        }
        # P, WRITE: D's release for a transfer that ended here is answered from this record.
        self.ended_verdicts = (
            EndedVerdicts(self.send, self.topology.tp_rank)
            if names.get("send") == "write_producer"
            else None
        )
        self.metrics = TransferMetrics({side: table.spec for side, table in tables.items()})
        self.poller = CompletionPoller(self._dispatch_adapter_event)
        self.posts = PostBatcher(self.poller, self._dispatch_adapter_event)
        self.context = HandlerContext(
            directory=self.directory,
            reports=self.reports,
            metrics=self.metrics,
            topology=self.topology,
            clock=self.clock,
            send=self.send,
            dispatch=self.dispatch,
            completion_of=self.posts.completion_of,
            forget_completions=self.poller.forget,
            reply_port=lambda: self.transport.notify_port,
            failure_log=self.failure_log,
        )
        self.drivers = {
            side: Driver(tables[side], handlers_for(name, self.context), clock=self.clock)
            for side, name in names.items()
        }
        self.preparation = WritePreparation(self.context, closed=lambda: self._closed)

    def _build_io(self, sides: tuple[str, ...]) -> None:
        """The transport and what listens to it, the transfers' starts and the timer thread."""
        settings, me = self.settings, self.topology
        self.reused_ids = ReusedIdReplies(self.send, me.tp_rank)
        inbound = Inbound(
            self.context,
            self.drivers,
            self.dispatch,
            self.reused_ids,
            self.preparation.prepare,
            self.ended_verdicts,
        )
        config = TransportConfig(
            role=Role.PRODUCER if sides == ("send",) else Role.CONSUMER,
            notify_base_port=settings.notify_port,
            dp_rank=me.dp_rank,
            tp_rank=me.tp_rank,
            tp_size=me.tp_size,
            bind_host=settings.host_ip or self.host,
            trusted_peers=settings.trusted_peers,
            **self._curve(),
        )
        try:
            self.transport = ZmqTransport(
                config, inbound.on_message, on_send_failure=inbound.on_send_failure
            )
        except BaseException:
            self.poller.close()  # nothing else started yet
            raise
        faults = dict(settings.fault_injection)
        self.message_faults = (
            MessageFaults(self.transport.send, faults) if wants_message_faults(faults) else None
        )
        tables = {side: driver.table for side, driver in self.drivers.items()}
        self.transfers = TransferStarts(
            self.context,
            tables,
            self.dispatch,
            read_mode=settings.read_mode,
            binding=PeerBinding(settings.bind_peers, self.transport),
            prepare=self.preparation.prepare,
        )
        self._ticker = Ticker(self.drivers, self._settled, settings.tick_interval)

    def _curve(self) -> dict:
        if not self.settings.curve:
            return {}
        from ..adapters.zmq import CurveConfig

        return {"curve": CurveConfig(**dict(self.settings.curve))}

    @property
    def engine(self) -> Any:
        """The transfer engine, from ``register_kv_caches`` on (None before)."""
        return self.context.engine

    @property
    def cache(self) -> LocalKvCache | None:
        return self.context.cache

    # -- events into the machines ------------------------------------------------------------

    def dispatch(self, side: str, event) -> list:
        """Dispatch ``event`` to ``side``'s machine; forget the transfer once it has ended.
        Returns every (event, result) the dispatch ran, in order.

        Layers posted while it runs go to the engine together when it ends (``posting.py``).
        """
        with self.posts.together(self.engine):
            # Settled before the block's end dispatches completions: a completion may end the
            # transfer, and its metrics must see this dispatch's steps first.
            results = self.drivers[side].dispatch(event)
            self._settled(side, results)
        return results

    def _settled(self, side: str, results) -> None:
        finals, now = self._finals[side], self.clock()
        for ev, result in results:
            self.metrics.observe(side, ev, result, now)
            if result.state in finals:
                if result.outcome is not Outcome.LATE:
                    self._ended(side, ev.transfer_id, result.state)
                self.directory.drop(ev.transfer_id)

    def _ended(self, side: str, transfer_id: str, state: str) -> None:
        if side == "send" and self.ended_verdicts is not None:
            info = self.directory.get(transfer_id)
            if info is not None:
                stopped = state not in self._anomalies[side]
                self.ended_verdicts.ended(transfer_id, info.peer, stopped)

    def _dispatch_adapter_event(self, event) -> None:
        side = "send" if event.kind.startswith("layer_write") else "receive"
        self.dispatch(side, event)

    def send(self, destination: tuple[str, int], message) -> None:
        """Queue a message; an immediate refusal raises, so the driver reports notify_failed."""
        if self.message_faults is not None:
            self.message_faults.send(destination, message)
        else:
            self.transport.send(destination, message)

    # -- vLLM's worker hooks -------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: dict, kv_format: LayerKVFormat, attention_backend: str = ""
    ) -> None:
        ctx, settings = self.context, self.settings
        ctx.cache = cache = LocalKvCache(kv_caches, kv_format, attention_backend=attention_backend)
        ctx.engine = engine = self._make_engine(self.topology.label(self.engine_id))
        if settings.fault_injection:
            inject_faults(engine, settings.fault_injection)
        cache.register(engine)
        self.reports.on_load_ended = engine.interrupt_help
        ctx.links = PeerLinks(
            lambda address: self.transport.request_handshake(address),
            engine,
            cache.summary,
            cache.names,
        )
        self.handshake_port = self.transport.serve_handshake(
            cache.handshake_reply(engine, self.engine_id),
            port=self.topology.own_port(settings.handshake_port),
            bind_host=settings.host_ip or self.host,
        )

    def start_step(self, metadata: StepMetadata | None) -> None:
        """Apply one step's metadata: new transfers first, then ended requests."""
        self._step_sends = []
        self._saved_this_step.clear()
        self._step_idle = metadata is not None and metadata.idle
        if not metadata:
            return
        if self.spans is not None:
            for link in metadata.traces:
                self.spans.link(link.transfer_id, link.request_id, link.headers)
        for refused in metadata.refused:
            self.reused_ids.refused(refused.transfer_id, refused.peer)
        for send in metadata.sends:
            if self.transfers.start_send(send):
                self._step_sends.append(send.transfer_id)
        for receive in metadata.receives:
            self.transfers.start_receive(receive)
        for ended in metadata.ended:
            self.transfers.end(ended)

    def save_layer(self, layer_name: str) -> None:
        """P, WRITE: ``layer_name`` of this forward is in memory: schedule its writes.

        With ``write_posting`` after_forward, layers wait for ``finish_saves``.
        """
        if not self._step_sends or self.cache is None or self.settings.posts_after_forward:
            return
        layer = self.cache.index.get(layer_name)
        if layer is None:
            return
        now, bit = self.clock(), 1 << layer
        saved = self._saved_this_step
        for tid in self._step_sends:
            if not saved.get(tid, 0) & bit:
                saved[tid] = saved.get(tid, 0) | bit
                self.dispatch("send", events.layer_scheduled(tid, now, layer))

    def finish_saves(self) -> None:
        """The forward ended: every layer is in memory; schedule any not seen, then seal.

        Each transfer's layers not scheduled yet go in one ``layers_scheduled`` step: one
        dispatch for the lot, so the dispatch's bookkeeping (trace, metrics, driver) is paid
        once, not once per layer before the last layer is posted.
        """
        if not self._step_sends or self.cache is None:
            return
        every = (1 << len(self.cache.names)) - 1
        now = self.clock()
        with self.posts.together(self.engine):  # every layer not yet posted, in one go
            for tid in self._step_sends:
                left = every & ~self._saved_this_step.get(tid, 0)
                if left:
                    self.dispatch("send", events.layers_scheduled(tid, now, left))
        now = self.clock()
        for tid in self._step_sends:
            self.dispatch("send", events.seal(tid, now))
        self._step_sends = []

    def finished(self) -> tuple[set[str], set[str]]:
        """What finished since the last call, after this step's wait (``step_waits.py``)."""
        wait_between_steps(
            self.engine,
            self.reports,
            idle_step=self._step_idle,
            writes_in=not self.settings.read_mode,
        )
        return self.reports.take()

    def load_errors(self) -> set[int]:
        return self.reports.take_load_errors()

    def interval_stats(self) -> dict[str, Any]:
        """This interval's metrics for vLLM (``get_kv_connector_stats``)."""
        rejected = self.transport.stats.get("rejected", 0)
        self.metrics.add_rejected_messages(rejected - self._rejected_seen)
        self._rejected_seen = rejected
        return self.metrics.snapshot()

    def stats(self) -> dict[str, Any]:
        out = {side: driver.stats() for side, driver in self.drivers.items()}
        out["transport"] = self.transport.stats
        out["reports"] = self.reports.outstanding()
        return out

    def close(self) -> None:
        """Stop every thread, close every socket, deregister the KV cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ticker.stop()
        self.poller.close()
        if self.message_faults is not None:
            self.message_faults.close()
        if self.context.links is not None:
            self.context.links.close()
        self.transport.close()
        if self.recorder is not None and hasattr(self.recorder, "close"):
            self.recorder.close()
        if self.engine is not None:
            try:
                if self.cache is not None:
                    self.cache.deregister(self.engine)
            finally:
                self.engine.close()
