"""A request's transfer starts or ends: the scheduler's news turned into creating and ending events.

Rules: a transfer starts only under an id no live or remembered transfer holds here
(``id_refusals.py``); a start the machine refuses is forgotten at once. A load that cannot
start fails at once, so vLLM's ``kv_load_failure_policy`` decides. A request that ends
before its transfer started here still ends it through the spec's own creating events
(``finished_before_start``, ``aborted_before_start``), so the peer is told and the blocks
go back by the machine's rules, not by events made up here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..logs import get_logger
from ..runtime.declared import events
from ..runtime.events import Outcome
from ..runtime.table import TransferTable
from .context import HandlerContext
from .directory import TransferInfo
from .id_refusals import IdRefusals
from .metadata import ReceiveStart, RequestEnded, SendStart
from .peer_binding import PeerBinding

log = get_logger("moriio_fsm.vllm")


class TransferStarts:
    """Starts and ends this rank's transfers as the scheduler's step metadata says."""

    def __init__(
        self,
        parts: HandlerContext,
        tables: Mapping[str, TransferTable],
        dispatch: Callable[[str, object], list],
        *,
        read_mode: bool,
        binding: PeerBinding,
        prepare: Callable[[str, object], None],
    ):
        self._parts = parts
        self._tables = tables
        self._dispatch = dispatch
        self._read_mode = read_mode
        self._binding = binding
        self._prepare = prepare
        self.refusals = IdRefusals(parts.directory, tables)

    def start_send(self, send: SendStart) -> bool:
        """P: start the transfer ``send`` names; True when this forward's layers feed it."""
        tid, parts = send.transfer_id, self._parts
        if not self.refusals.may_start("send", send.request_id, tid):
            return False  # P prefills without sending; its blocks go back when it ends
        info = TransferInfo(send.request_id, send.block_ids, send.peer)
        if not parts.directory.add(tid, info):
            log.error("vllm.transfer_refused", transfer_id=tid, why="too many live transfers")
            return False
        if send.peer is not None:
            info.link = parts.link_for(
                info,
                parts.topology.first_peer_rank(send.peer),
                parts.topology.head_slice(send.peer),
            )
        writers = parts.topology.writers_into_peer(send.peer)
        created = events.prefill_started(
            tid,
            parts.clock(),
            writers,
            send.prompt_digest,
            send.peer.dp_rank if send.peer else -1,
            source=self._binding.source_for(send.peer),
        )
        if not self._created("send", created, send.request_id):
            return False  # as refused: no write will start; the blocks go back at the end
        # D often allocates before P's scheduler starts the transfer (a proxy sends both at
        # once): the machine held remote_blocks until now, so prepare its writes here.
        # (The machine sets remote_block_ids before has_allocation, so this read needs no lock.)
        made = self._tables["send"].get(tid)
        if made is not None and made.has_allocation:
            self._prepare(tid, made.remote_block_ids)
        return True

    def start_receive(self, receive: ReceiveStart) -> None:
        """D: start the load ``receive`` names (READ: its reads; WRITE: tell P the blocks)."""
        tid, rid, parts = receive.transfer_id, receive.request_id, self._parts
        if self._read_mode and not receive.block_ids:
            return  # nothing to read (a prefix hit, or bad params): no transfer
        if not self.refusals.may_start("receive", rid, tid):
            self._fail_load(rid, receive.block_ids)
            return
        info = TransferInfo(
            rid,
            receive.block_ids,
            receive.peer,
            receive.remote_block_ids,
            prompt_digest=receive.prompt_digest,
        )
        if not parts.directory.add(tid, info):
            log.error("vllm.transfer_refused", transfer_id=tid, why="too many live transfers")
            self._fail_load(rid, receive.block_ids)
            return
        now, bound = parts.clock(), self._binding.source_for(receive.peer)
        if self._read_mode:
            started = events.read_started(
                tid, now, len(parts.kv_cache().names), list(receive.remote_block_ids), source=bound
            )
        else:
            started = events.receive_started(
                tid, now, len(parts.topology.peer_ranks(receive.peer)), source=bound
            )
        if not self._created("receive", started, rid):
            self._fail_load(rid, receive.block_ids)
            return
        if receive.block_ids:
            parts.reports.expect_recving(rid)
        if self._read_mode:
            self._dispatch("receive", events.start_reads(tid, now))
        elif receive.block_ids:
            self._dispatch(
                "receive", events.blocks_allocated(tid, now, list(receive.block_ids), rid)
            )
        else:
            self._dispatch("receive", events.request_finished(tid, now))

    def end(self, ended: RequestEnded) -> None:
        """vLLM finished or aborted a request that had a transfer on ``ended.side``."""
        tid, side, reports = ended.transfer_id, ended.side, self._parts.reports
        if side not in self._tables:
            return
        info = self._parts.directory.get(tid)
        refused = self.refusals.forget(ended.request_id)
        if refused or (info is not None and info.request_id != ended.request_id):
            # Its transfer id was another request's: this request moved nothing, so vLLM
            # gets its blocks back at once and the other request's transfer is left alone.
            if ended.awaits_report:
                reports.expect_sending(ended.request_id)
                reports.sent(ended.request_id)
            return
        if ended.awaits_report:
            reports.expect_sending(ended.request_id)
        if side == "send" and self._read_mode:
            self._serve(ended)
        elif self._tables[side].get(tid) is not None:
            now = self._parts.clock()
            self._dispatch(
                side,
                events.abort(tid, now)
                if side == "send" and ended.aborted
                else events.request_finished(tid, now),
            )
        elif self._tables[side].state_of(tid) is None and not (
            side == "receive" and self._read_mode
        ):
            self._end_unstarted(ended)
        # Else it ended here already (its request's end is news to no one), or it is a READ
        # load that never started: D holds nothing of it, and P's lease frees P's side.

    def _serve(self, ended: RequestEnded) -> None:
        """READ P: the request finished, so its blocks wait for D's reads from now on."""
        tid, now = ended.transfer_id, self._parts.clock()
        if not self.refusals.may_start("send", ended.request_id, tid):
            # Freed at once: the scheduler refuses a reused id before it hands out the
            # request's blocks, so no read can be aimed at them.
            self.refusals.forget(ended.request_id)
            self._parts.reports.sent(ended.request_id)
            return
        self._parts.directory.add(tid, TransferInfo(ended.request_id, ended.block_ids, None))
        self._dispatch(
            "send", events.serve_started(tid, now, 1, source=self._binding.source_for(None))
        )
        self._dispatch("send", events.request_finished(tid, now))

    def _end_unstarted(self, ended: RequestEnded) -> None:
        """The request ended before its transfer started here: the spec's creating event for
        that ends it (tells the peer, hands the blocks back if vLLM waits for them)."""
        tid, now = ended.transfer_id, self._parts.clock()
        self._parts.directory.add(tid, TransferInfo(ended.request_id, (), ended.peer))
        source = self._binding.source_for(ended.peer)
        if ended.side == "send" and ended.aborted:
            self._dispatch("send", events.aborted_before_start(tid, now, source=source))
        else:
            self._dispatch(ended.side, events.finished_before_start(tid, now, source=source))

    def _created(self, side: str, event, request_id: str) -> bool:
        """Dispatch a creating event; when the machine refuses it (a payload its guards
        refuse, such as more writers than it allows), forget the transfer and say why."""
        results = self._dispatch(side, event)
        if results and results[0][1].outcome is Outcome.CREATED:
            return True
        self._parts.directory.drop(event.transfer_id)
        self.refusals.remember(request_id, event.transfer_id)
        log.warning(
            "vllm.transfer_refused",
            transfer_id=event.transfer_id,
            request_id=request_id,
            why=f"the {self._tables[side].spec.name} machine refused its start "
            f"({event.kind} {event.data})",
        )
        return False

    def _fail_load(self, request_id: str, block_ids) -> None:
        """A load that cannot start: vLLM's ``kv_load_failure_policy`` decides at once."""
        if block_ids:
            self._parts.reports.expect_recving(request_id)
            self._parts.reports.received(request_id, tuple(block_ids))
