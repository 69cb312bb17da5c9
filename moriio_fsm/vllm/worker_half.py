"""The connector's worker half: every transfer of this rank is one machine, run by a driver.

It owns the rank's transport (notify listener, senders, handshake server), the transfer
engine with the registered KV cache, the completion poller and one table + driver per
machine its role needs. vLLM's hooks only turn into events here: the forward thread
dispatches and posts, never waits for RDMA or a socket; messages, completions and timers
arrive on their own threads. What the events mean is the specs' business.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Any, Callable

from ..engines.interface import TransferEngine
from ..engines.poller import CompletionPoller
from ..adapters.zmq import (Delivery, Heartbeat, Role, SendFailure, TransportConfig, WriteFailed,
                            ZmqTransport, event_for)
from ..adapters.zmq.errors import ZmqAdapterError
from ..adapters.zmq.reporting import LogLimiter
from ..adapters.zmq.senders import AddressCache, expected_senders
from ..layout import LayerKVFormat
from ..logs import get_logger
from ..machines import build_table
from ..runtime.declared import events
from ..runtime.events import Outcome
from ..runtime.driver import Driver
from ..runtime.table import FIRST_SENDER
from .directory import TransferDirectory, TransferInfo
from .kv_cache import LocalKvCache
from .message_faults import MessageFaults, wants_message_faults
from .metrics import TransferMetrics
from .metadata import ReceiveStart, RequestEnded, SendStart, StepMetadata
from .peers import PeerLinks
from .reports import VllmReports
from .reused_ids import ReusedIdReplies
from .settings import ConnectorConfigError, ConnectorSettings

log = get_logger("moriio_fsm.vllm")

#: Which machines each side runs, by mode.
MACHINES = {("write", "send"): "write_producer", ("write", "receive"): "write_consumer",
            ("read", "send"): "read_producer", ("read", "receive"): "read_consumer"}


def peer_ranks(my_rank: int, my_tp: int, peer_tp: int) -> list[int]:
    """The peer TP ranks that exchange KV with ``my_rank`` (heads are split by TP rank).

    With more peer ranks than ours each of ours pairs with a group of them; with fewer,
    several of ours share one.
    """
    if peer_tp >= my_tp:
        group = peer_tp // my_tp
        return list(range(my_rank * group, (my_rank + 1) * group))
    return [my_rank * peer_tp // my_tp]


ENGINE_FAULTS = ("fail_nth", "stall_nth", "drop_nth", "drop_all", "fail_rate", "latency_s")


def inject_faults(engine: TransferEngine, faults: dict) -> None:
    """Arm the engine's fault injection from the ``fault_injection`` setting."""
    if not any(faults.get(name) for name in ENGINE_FAULTS):
        return                       # only control-message faults (message_faults.py)
    rules = engine.faults
    if rules is None:
        raise ConnectorConfigError(f"kv_connector_extra_config['fault_injection']: the "
                                   f"{type(engine).__name__} injects no faults; use the "
                                   "same_host backend")
    for name, arm in (("fail_nth", rules.fail_nth), ("stall_nth", rules.stall_nth), ("drop_nth", rules.drop_nth)):
        if name in faults:
            arm(faults[name])
    if faults.get("drop_all"):
        rules.drop_when(lambda posted: True)
    if faults.get("fail_rate"):
        chance = random.Random(faults.get("seed", 0))
        lock = threading.Lock()

        def unlucky(posted) -> bool:
            with lock:
                return chance.random() < faults["fail_rate"]

        rules.fail_when(unlucky, message="injected failure (fault_injection.fail_rate)")
    if faults.get("latency_s"):
        rules.set_latency(faults["latency_s"], seed=faults.get("seed", 0))


class _ThreadPosts(threading.local):
    collected: list | None = None    # this thread's posts awaiting their flush, inside a posting block


class WorkerHalf:
    """One rank's transfers: tables, drivers, transport, engine, poller, reports."""

    def __init__(self, settings: ConnectorSettings, *, engine_id: str, sides: tuple[str, ...],
                 tp_rank: int, tp_size: int, dp_rank: int,
                 make_engine: Callable[[str], Any], host: str,
                 clock: Callable[[], float] = time.monotonic, recorder: Any = None):
        self.settings = settings
        self.engine_id = engine_id
        self.tp_rank, self.tp_size, self.dp_rank = tp_rank, tp_size, dp_rank
        self.host = host
        self.clock = clock
        self._make_engine = make_engine
        self.reports = VllmReports()
        self.directory = TransferDirectory()
        self.engine: Any = None
        self.cache: LocalKvCache | None = None
        self.peers: PeerLinks | None = None
        self.handshake_port: int | None = None
        self._closed = False
        self._step_sends: list[str] = []          # P, WRITE: transfers saved by this forward
        self._step_idle = False                    # this step runs no forward (StepMetadata.idle)
        self._posts = _ThreadPosts()
        self._saved_this_step: dict[str, int] = {}  # P, WRITE: transfer -> bitmap of layers this forward scheduled
        self._prepare_lock = threading.Lock()
        self._addresses = AddressCache()
        # Requests whose start was refused here (their transfer id was taken), until they end.
        self._refused: dict[str, str] = {}
        self._forged_log = LogLimiter(per_second=5)
        #: Rate-limits the warnings about failed transfers (a storm of them says so once a second).
        self.failure_log = LogLimiter(per_second=20)
        if recorder is None:
            recorder = self._make_recorder()
        self.recorder = recorder
        self.drivers: dict[str, Driver] = {}
        self._finals: dict[str, frozenset[str]] = {}
        for side in sides:
            name = MACHINES[(settings.mode, side)]
            table = build_table(name, config=settings.machine_overrides(name), recorder=recorder)
            self.drivers[side] = Driver(table, self._handlers(name), clock=clock)
            self._finals[side] = frozenset(table.spec.final_states)
        self.metrics = TransferMetrics({side: d.table.spec for side, d in self.drivers.items()})
        self._rejected_seen = 0
        role = Role.PRODUCER if sides == ("send",) else Role.CONSUMER
        self.transport = ZmqTransport(
            TransportConfig(role=role, notify_base_port=settings.notify_port,
                            dp_rank=dp_rank, tp_rank=tp_rank, tp_size=tp_size,
                            bind_host=settings.host_ip or host,
                            trusted_peers=settings.trusted_peers, **self._curve()),
            self._on_message, on_send_failure=self._on_send_failure)
        faults = dict(settings.fault_injection)
        self.message_faults = (MessageFaults(self.transport.send, faults)
                               if wants_message_faults(faults) else None)
        self.reused_ids = ReusedIdReplies(self.send, tp_rank)
        self.poller = CompletionPoller(self._dispatch_adapter_event)
        self._ticker = threading.Thread(target=self._tick, name="moriio-fsm-timers", daemon=True)
        self._ticker.start()

    def _trace_path(self, template: str | None) -> str | None:
        if not template:
            return None
        path = template.format(engine_id=self.engine_id, dp_rank=self.dp_rank, tp_rank=self.tp_rank)
        if path == template and (self.tp_size > 1 or self.dp_rank > 0):
            stem, dot, suffix = path.rpartition(".")
            path = f"{stem}-dp{self.dp_rank}-tp{self.tp_rank}{dot}{suffix}" if dot else \
                f"{path}-dp{self.dp_rank}-tp{self.tp_rank}"
        return path

    def _make_recorder(self):
        """The trace recorder the settings ask for (a flight recorder by default), or None."""
        settings = self.settings
        file, dump = self._trace_path(settings.trace_file), self._trace_path(settings.trace_dump_file)
        if settings.trace_ring_size == 0 and file is None and dump is None:
            return None
        from ..trace import TraceRecorder

        return TraceRecorder(f"{self.engine_id}-dp{self.dp_rank}-tp{self.tp_rank}",
                             ring=max(settings.trace_ring_size, 1), file=file, dump=dump)

    def _curve(self) -> dict:
        if not self.settings.curve:
            return {}
        from ..adapters.zmq import CurveConfig

        return {"curve": CurveConfig(**dict(self.settings.curve))}

    def _handlers(self, machine: str) -> dict:
        if machine.startswith("write"):
            from .write_handlers import producer_handlers, consumer_handlers
        else:
            from .read_handlers import producer_handlers, consumer_handlers
        return producer_handlers(self) if machine.endswith("producer") else consumer_handlers(self)

    # -- dispatching -------------------------------------------------------------------------

    def driver_for(self, side: str) -> Driver:
        return self.drivers[side]

    def dispatch(self, side: str, event) -> list:
        """Dispatch ``event`` to ``side``'s machine; forget the transfer once it has ended.
        Returns every (event, result) the dispatch ran, in order.

        Layers posted while it runs go to the engine together when it ends (one kernel call
        for a transfer's layers on the same-host engine), and the completions of those the
        engine copied at once are dispatched here, on this thread.
        """
        with self._posting_together():
            # Settled before the block's end dispatches completions: a completion may end the
            # transfer, and its metrics must see this dispatch's steps first.
            results = self.drivers[side].dispatch(event)
            self._settled(side, results)
        return results

    @contextlib.contextmanager
    def _posting_together(self):
        local = self._posts
        if self.engine is None or local.collected is not None:
            yield                        # no engine yet, or an outer dispatch of this thread flushes
            return
        local.collected = []
        try:
            with self.engine.posting_together():
                yield
        finally:
            collected, local.collected = local.collected, None
            # Every completion's event is made before any is dispatched, so each carries the
            # time its copy ended, not that time plus the dispatches of the layers before it.
            completed = [(self.poller.event_if_final(*posted), posted) for posted in collected]
            for event, posted in completed:
                self._complete(event, *posted)

    def _complete(self, event, status, transfer_id: str, layer: int, op: str) -> None:
        if event is None:
            try:
                self.poller.submit(status, transfer_id, layer, op)
            except RuntimeError:         # closing: nothing waits for this completion any more
                pass
            return
        try:
            self._dispatch_adapter_event(event)
        except Exception:               # the other layers' completions still go out
            log.exception("vllm.completion_failed", transfer_id=transfer_id, layer=layer)

    def _settled(self, side: str, results) -> None:
        finals, now = self._finals[side], self.clock()
        for ev, result in results:
            self.metrics.observe(side, ev, result, now)
            if result.state in finals:
                self.directory.drop(ev.transfer_id)

    def _dispatch_adapter_event(self, event) -> None:
        side = "send" if event.kind.startswith("layer_write") else "receive"
        self.dispatch(side, event)

    def _on_message(self, delivery: Delivery) -> None:
        message = delivery.message
        try:
            event = event_for(message, self.clock(), delivery.source)
        except Exception as exc:                 # never let one message stop the listener
            log.warning("vllm.message_dropped", message=type(message).__name__, error=str(exc))
            return
        side = self._side_of(event.kind)
        if side is None:
            log.debug("vllm.message_dropped", kind=event.kind, transfer_id=event.transfer_id,
                      why="this rank runs no machine that takes it")
            return
        undo = self._note_reply_address(message, delivery)
        results = self.dispatch(side, event)
        outcome = results[0][1].outcome if results else None
        if undo is not None and outcome is not Outcome.APPLIED:
            undo()                       # a heartbeat the machine did not take says nothing
        if (event.kind == "remote_blocks" and side == "send"
                and outcome in (Outcome.LATE, Outcome.BUFFERED, Outcome.DROPPED)):
            self.reused_ids.unanswered_allocation(event.transfer_id, event.decode_rank)
        if outcome is Outcome.FORGED and self._forged_log.allow(self.clock()):
            log.warning("vllm.message_forged", kind=event.kind, transfer_id=event.transfer_id,
                        sender=delivery.source,
                        why="the transfer takes messages only from the peer its request named")
        elif (outcome is Outcome.APPLIED and type(message) is WriteFailed
              and self.failure_log.allow(self.clock())):
            log.warning("vllm.peer_failed_transfer", transfer_id=event.transfer_id,
                        reason=message.reason or "", writes_stopped=message.writes_stopped)
        # Only an allocation the machine stored: a duplicate, or one an ending transfer
        # ignored, is posted to by nothing.
        if event.kind == "remote_blocks" and side == "send" and any(
                done is event and result.outcome is Outcome.APPLIED for done, result in results or ()):
            self._prepare_writes(event.transfer_id, event.block_ids)

    def _note_reply_address(self, message, delivery: Delivery):
        """READ P: where a heartbeat's sender wants its lease grants, noted before the
        dispatch whose grant needs it; returns how to take the note back, or None."""
        if type(message) is not Heartbeat or message.reply_port is None or not delivery.peer.address:
            return None
        info = self.directory.get(message.transfer_id)
        rank = message.consumer_rank if message.consumer_rank is not None else 0
        if info is None or (rank not in info.reply_to and len(info.reply_to) >= 4096):
            return None
        before = info.reply_to.get(rank)
        # Grants go back to the address the heartbeat came from, never to one it names.
        info.reply_to[rank] = (delivery.peer.address, message.reply_port)

        def undo() -> None:
            if before is None:
                info.reply_to.pop(rank, None)
            else:
                info.reply_to[rank] = before
        return undo

    def _prepare_writes(self, transfer_id: str, remote_ids) -> None:
        """P, WRITE: D's blocks are known; make the transfer's plans and sessions now, or once
        the link to D is up.

        This runs before or during P's forward (on the forward, I/O or handshake thread), so
        posting after the forward is only the posts. Best effort: whatever fails here fails
        again, and is reported, when the layer is posted.
        """
        info = self.directory.get(transfer_id)
        remote_ids = tuple(remote_ids)
        if info is None or self.cache is None or info.link is None or not remote_ids:
            return
        with self._prepare_lock:     # several threads may learn of one allocation: prepare once
            if info.prepared_for == remote_ids:
                return
            info.prepared_for = remote_ids
        if not info.link.done():
            info.link.add_done_callback(lambda _: self._prepared(transfer_id, info, remote_ids))
            return
        self._prepared(transfer_id, info, remote_ids)

    def _prepared(self, transfer_id: str, info: TransferInfo, remote_ids: tuple[int, ...]) -> None:
        """Make every layer's plan and session for ``remote_ids``, unless the transfer ended."""
        if self._closed or self.directory.get(transfer_id) is not info:
            return                   # ended meanwhile: nothing will be posted
        try:
            if info.link.cancelled() or info.link.exception() is not None:
                return
            local_ids = info.local_ids_for(remote_ids)
            num_blocks = info.link.result().num_blocks
            for layer in range(len(self.cache.names)):
                self.cache.plan(local_ids, remote_ids, num_blocks, layer)
                info.session(self.engine, self.cache, layer)
        except Exception as exc:
            log.debug("vllm.prepare_writes_failed", transfer_id=transfer_id, error=str(exc))

    def _side_of(self, kind: str) -> str | None:
        for side, driver in self.drivers.items():
            if kind in driver.table.spec.events:
                return side
        return None

    def _on_send_failure(self, failure: SendFailure) -> None:
        if failure.transfer_id is None:
            return
        for side, driver in self.drivers.items():
            if driver.table.get(failure.transfer_id) is not None:
                self.dispatch(side, events.notify_failed(failure.transfer_id, self.clock(),
                                                         f"{failure.kind}: {failure.reason}"))
                return

    def _tick(self) -> None:
        interval = self.settings.tick_interval
        while not self._closed:
            for side, driver in list(self.drivers.items()):
                try:
                    self._settled(side, driver.advance())
                except Exception:
                    log.exception("vllm.timer_step_failed", side=side)
            time.sleep(interval)

    # -- addressing ------------------------------------------------------------------------

    def notify_endpoint(self, info: TransferInfo, peer_rank: int) -> tuple[str, int]:
        peer = info.peer
        return peer.host, peer.notify_port + peer.dp_rank * peer.tp_size + peer_rank

    def handshake_endpoint(self, info: TransferInfo, peer_rank: int) -> tuple[str, int]:
        peer = info.peer
        return peer.host, peer.handshake_port + peer.dp_rank * peer.tp_size + peer_rank

    def link_for(self, info: TransferInfo, peer_rank: int):
        """The future ``PeerLink`` to the peer rank of ``info`` (one handshake per rank)."""
        return self.peers.link(self.handshake_endpoint(info, peer_rank))

    def completion_of(self, status, transfer_id: str, layer: int, op: str):
        """A posted layer's completion event for the handler to return, if the engine already
        finished it (copied as it posted); else None, and the completion comes later: from
        this thread's dispatch once its posts went together, or from the poller."""
        event = self.poller.event_if_final(status, transfer_id, layer, op)
        if event is not None:
            return event
        collected = self._posts.collected
        if collected is not None:
            collected.append((status, transfer_id, layer, op))
        else:
            self.poller.submit(status, transfer_id, layer, op)
        return None

    def send(self, destination: tuple[str, int], message) -> None:
        """Queue a message; an immediate refusal raises, so the driver reports notify_failed."""
        if self.message_faults is not None:
            self.message_faults.send(destination, message)
        else:
            self.transport.send(destination, message)

    # -- vLLM's worker hooks -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict, kv_format: LayerKVFormat,
                           attention_backend: str = "") -> None:
        self.cache = LocalKvCache(kv_caches, kv_format, attention_backend=attention_backend)
        self.engine = self._make_engine(f"{self.engine_id}-dp{self.dp_rank}-tp{self.tp_rank}")
        if self.settings.fault_injection:
            inject_faults(self.engine, self.settings.fault_injection)
        self.cache.register(self.engine)
        self.reports.on_load_ended = self.engine.interrupt_help
        self.peers = PeerLinks(lambda address: self.transport.request_handshake(address),
                               self.engine, self.cache.summary, self.cache.names)
        port = self.settings.handshake_port + self.dp_rank * self.tp_size + self.tp_rank
        self.handshake_port = self.transport.serve_handshake(
            self.cache.handshake_reply(self.engine, self.engine_id), port=port,
            bind_host=self.settings.host_ip or self.host)

    def start_step(self, metadata: StepMetadata | None) -> None:
        """Apply one step's metadata: new transfers first, then ended requests."""
        self._step_sends = []
        self._saved_this_step.clear()
        self._step_idle = metadata is not None and metadata.idle
        if not metadata:
            return
        for refused in metadata.refused:
            self.reused_ids.refused(refused.transfer_id, refused.peer)
        for send in metadata.sends:
            self._start_send(send)
        for receive in metadata.receives:
            self._start_receive(receive)
        for ended in metadata.ended:
            self._end(ended)

    def _start_send(self, send: SendStart) -> None:
        tid = send.transfer_id
        if not self._may_start("send", send.request_id, tid):
            return               # P prefills without sending; its blocks go back when it ends
        info = TransferInfo(send.request_id, send.block_ids, send.peer)
        if not self.directory.add(tid, info):
            log.error("vllm.transfer_refused", transfer_id=tid, why="too many live transfers")
            return
        writers = max(1, self.tp_size // (send.peer.tp_size if send.peer else 1))
        if send.peer is not None:
            info.link = self.link_for(info, peer_ranks(self.tp_rank, self.tp_size, send.peer.tp_size)[0])
        created = events.prefill_started(tid, self.clock(), writers, send.prompt_digest,
                                         send.peer.dp_rank if send.peer else -1,
                                         source=self._binding(send.peer))
        if not self._created("send", created, send.request_id):
            return               # as refused: no write will start; the blocks go back at the end
        # D often allocates before P's scheduler starts the transfer (a proxy sends both at
        # once): the machine held remote_blocks until now, so prepare its writes here.
        # (The machine sets remote_block_ids before has_allocation, so this read needs no lock.)
        made = self.drivers["send"].table.get(tid)
        if made is not None and made.has_allocation:
            self._prepare_writes(tid, made.remote_block_ids)
        self._step_sends.append(tid)

    def _start_receive(self, receive: ReceiveStart) -> None:
        tid, rid = receive.transfer_id, receive.request_id
        if self.settings.read_mode and not receive.block_ids:
            return               # nothing to read (a prefix hit, or bad params): no transfer
        if not self._may_start("receive", rid, tid):
            self._fail_load(rid, receive.block_ids)
            return
        info = TransferInfo(rid, receive.block_ids, receive.peer, receive.remote_block_ids,
                            prompt_digest=receive.prompt_digest)
        if not self.directory.add(tid, info):
            log.error("vllm.transfer_refused", transfer_id=tid, why="too many live transfers")
            self._fail_load(rid, receive.block_ids)
            return
        now, bound = self.clock(), self._binding(receive.peer)
        if self.settings.read_mode:
            started = events.read_started(tid, now, len(self.cache.names),
                                          list(receive.remote_block_ids), source=bound)
        else:
            writers = len(peer_ranks(self.tp_rank, self.tp_size, receive.peer.tp_size))
            started = events.receive_started(tid, now, writers, source=bound)
        if not self._created("receive", started, rid):
            self._fail_load(rid, receive.block_ids)
            return
        if receive.block_ids:
            self.reports.expect_recving(rid)
        if self.settings.read_mode:
            self.dispatch("receive", events.start_reads(tid, now))
        elif receive.block_ids:
            self.dispatch("receive", events.blocks_allocated(tid, now, list(receive.block_ids), rid))
        else:
            self.dispatch("receive", events.request_finished(tid, now))

    def _created(self, side: str, event, request_id: str) -> bool:
        """Dispatch a creating event; when the machine refuses it (a payload its guards
        refuse, such as more writers than it allows), forget the transfer and say why."""
        results = self.dispatch(side, event)
        if results and results[0][1].outcome is Outcome.CREATED:
            return True
        self.directory.drop(event.transfer_id)
        self._remember_refused(request_id, event.transfer_id)
        log.warning("vllm.transfer_refused", transfer_id=event.transfer_id, request_id=request_id,
                    why=f"the {self.drivers[side].table.spec.name} machine refused its start "
                        f"({event.kind} {event.data})")
        return False

    def _fail_load(self, request_id: str, block_ids) -> None:
        """A load that cannot start: vLLM's ``kv_load_failure_policy`` decides at once."""
        if block_ids:
            self.reports.expect_recving(request_id)
            self.reports.received(request_id, tuple(block_ids))

    def _may_start(self, side: str, request_id: str, transfer_id: str) -> bool:
        """Whether ``request_id`` may start ``transfer_id`` here: no live or remembered
        transfer has that id. A refusal is logged with both requests and remembered until
        the request ends, so its end reaches no other request's machine."""
        holder = self._holder_of(side, transfer_id)
        if holder is None:
            return True
        self._remember_refused(request_id, transfer_id)
        log.warning("vllm.transfer_id_in_use", transfer_id=transfer_id, request_id=request_id,
                    held_by=holder, then="refused: a load fails (vLLM's load failure policy), "
                                         "a send does not start")
        return False

    def _remember_refused(self, request_id: str, transfer_id: str) -> None:
        if len(self._refused) >= 1 << 16:
            self._refused.pop(next(iter(self._refused)))
        self._refused[request_id] = transfer_id

    def _holder_of(self, side: str, transfer_id: str) -> str | None:
        info = self.directory.get(transfer_id)
        if info is not None:
            return f"live request {info.request_id!r}"
        state = self.drivers[side].table.state_of(transfer_id)
        return None if state is None else f"a transfer of this id that is {state!r}"

    def _binding(self, peer) -> str:
        """The source a transfer's creating event carries: the peer whose messages it takes
        (the host its request named; the first to speak where none is named)."""
        if not self.settings.bind_peers:
            return ""
        if peer is None:
            return FIRST_SENDER
        if not self.transport.policy.is_trusted(peer.host):
            return "-"           # never dialled, never believed: the transfer fails by its timers
        # Never waits for a name's lookup (this is the forward thread): until its first
        # answer, the transfer takes the first sender it hears from.
        bound = expected_senders(peer.host, self.transport.config.curve, self._addresses)
        return FIRST_SENDER if bound is None else bound

    def _end(self, ended: RequestEnded) -> None:
        now, tid = self.clock(), ended.transfer_id
        side = ended.side
        if side not in self.drivers:
            return
        table = self.drivers[side].table
        info = self.directory.get(tid)
        if self._refused.pop(ended.request_id, None) is not None or (
                info is not None and info.request_id != ended.request_id):
            # Its transfer id was another request's: this request moved nothing, so vLLM
            # gets its blocks back at once and the other request's transfer is left alone.
            if ended.awaits_report:
                self.reports.expect_sending(ended.request_id)
                self.reports.sent(ended.request_id)
            return
        if ended.awaits_report:
            self.reports.expect_sending(ended.request_id)
        if side == "send" and self.settings.read_mode:
            if not self._may_start(side, ended.request_id, tid):
                # Freed at once: the scheduler refuses a reused id before it hands out the
                # request's blocks, so no read can be aimed at them.
                self._refused.pop(ended.request_id, None)
                self.reports.sent(ended.request_id)
                return
            self.directory.add(tid, TransferInfo(ended.request_id, ended.block_ids, None))
            self.dispatch(side, events.serve_started(tid, now, 1, source=self._binding(None)))
            self.dispatch(side, events.request_finished(tid, now))
            return
        if table.get(tid) is None:
            if table.state_of(tid) is not None:
                return                   # it ended here already: the request's end is news to no one
            if side == "receive" and self.settings.read_mode:
                # D holds nothing of a READ that never started here (no blocks were
                # allocated) or that already ended; P's lease frees P's side.
                return
            # The transfer never started here: start it so its machine ends it properly
            # (tells the peer, hands the blocks back if vLLM waits for them).
            self.directory.add(tid, TransferInfo(ended.request_id, (), ended.peer))
            bound = self._binding(ended.peer)
            if side == "send":
                self.dispatch(side, events.prefill_started(tid, now, 1, source=bound))
            else:
                self.dispatch(side, events.receive_started(tid, now, 1, source=bound))
        if side == "send" and ended.aborted:
            self.dispatch(side, events.abort(tid, now))
        else:
            self.dispatch(side, events.request_finished(tid, now))

    def save_layer(self, layer_name: str) -> None:
        """P, WRITE: ``layer_name`` of this forward is in memory: schedule its writes.

        With ``write_posting`` after_forward, layers wait for ``finish_saves``.
        """
        if not self._step_sends or self.cache is None or self.settings.posts_after_forward:
            return
        self._schedule_layer(layer_name)

    def _schedule_layer(self, layer_name: str) -> None:
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

        Each transfer's layers not scheduled yet go in one ``layers_scheduled`` step (after the
        forward, all of them): one dispatch for the lot, so the dispatch's bookkeeping (trace,
        metrics, driver) is paid once, not once per layer before the last layer is posted.
        """
        if not self._step_sends or self.cache is None:
            return
        every = (1 << len(self.cache.names)) - 1
        now = self.clock()
        with self._posting_together():   # every layer not yet posted, in one go
            for tid in self._step_sends:
                left = every & ~self._saved_this_step.get(tid, 0)
                if left:
                    self.dispatch("send", events.layers_scheduled(tid, now, left))
        now = self.clock()
        for tid in self._step_sends:
            self.dispatch("send", events.seal(tid, now))
        self._step_sends = []

    def finished(self) -> tuple[set[str], set[str]]:
        """What finished since the last call. On a step with no forward while a load is pending,
        first helps with peers' writes into this engine (copy assist); on one core lets a copy
        in flight end (briefly). vLLM's engine loop asks without pause while a request waits
        for KV: this keeps it from spinning on the core a copy needs. How long each waits is
        the engine's tuning; a load that ends ends the wait at once (``VllmReports.on_load_ended``)."""
        engine = self.engine
        if engine is not None and self._step_idle and not self.settings.read_mode and self.reports.loads_pending():
            # Nothing else would use this core: wait for a writer's job instead of spinning
            # through empty steps. Other steps do not help: their core is the forward's.
            engine.help_writers()
        # Only an engine copying inline shares this core with the loop; with cores to spare,
        # waiting would only delay other requests' steps.
        if engine is not None and engine.inline_copies:
            engine.wait_for_copies()
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
        self._ticker.join(timeout=2.0)
        self.poller.close()
        if self.message_faults is not None:
            self.message_faults.close()
        if self.peers is not None:
            self.peers.close()
        self.transport.close()
        if self.recorder is not None and hasattr(self.recorder, "close"):
            self.recorder.close()
        if self.engine is not None:
            try:
                if self.cache is not None:
                    self.cache.deregister(self.engine)
            finally:
                self.engine.close()
