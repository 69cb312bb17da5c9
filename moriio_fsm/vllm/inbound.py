"""Messages from peers turned into events for this rank's machines, on the transport's thread.

Rules: a message that cannot become an event, or that no machine of this rank takes, is
logged and dropped; the listener never dies on one. What a message means is the machines'
business: this module only notes where a READ D wants its lease grants (taken back when the
machine did not take the heartbeat), answers allocations for ids refused as used and
releases for transfers that ended here (``ended_verdicts.py``), starts
preparing writes for an allocation the machine stored, says when a message was forged, and
makes a write_done from a P whose rank count D did not wait for a failure (``_writers_match``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..adapters.zmq import Delivery, Heartbeat, SendFailure, WriteFailed, event_for
from ..adapters.zmq.reporting import LogLimiter
from ..logs import get_logger
from ..runtime.declared import events
from ..runtime.driver import Driver
from ..runtime.events import Outcome
from .context import HandlerContext
from .ended_verdicts import EndedVerdicts
from .reused_ids import ReusedIdReplies

log = get_logger("moriio_fsm.vllm")

#: Reply addresses a READ P keeps per transfer at most (one per D rank).
MAX_REPLY_ADDRESSES = 4096
#: What P makes of D's allocation when its machine did not store it.
_UNTAKEN = (Outcome.LATE, Outcome.BUFFERED, Outcome.DROPPED)


class Inbound:
    """Turns each delivered message into an event for the machine of the side that takes it."""

    def __init__(
        self,
        parts: HandlerContext,
        drivers: Mapping[str, Driver],
        dispatch: Callable[[str, object], list],
        reused_ids: ReusedIdReplies,
        prepare: Callable[[str, object], None],
        ended_verdicts: EndedVerdicts | None = None,
    ):
        self._parts = parts
        self._drivers = drivers
        self._dispatch = dispatch
        self._reused_ids = reused_ids
        self._prepare = prepare
        self._ended_verdicts = ended_verdicts
        self._forged_log = LogLimiter(per_second=5)

    def on_message(self, delivery: Delivery) -> None:
        message, clock = delivery.message, self._parts.clock
        try:
            # Any: a declared event, whose payload fields (decode_rank...) are its spec's.
            event: Any = event_for(message, clock(), delivery.source)
        except Exception as exc:  # never let one message stop the listener
            log.warning("vllm.message_dropped", message=type(message).__name__, error=str(exc))
            return
        event = self._writers_match(event)
        side = self._side_of(event.kind)
        if side is None:
            log.debug(
                "vllm.message_dropped",
                kind=event.kind,
                transfer_id=event.transfer_id,
                why="this rank runs no machine that takes it",
            )
            return
        undo = self._note_reply_address(message, delivery)
        results = self._dispatch(side, event)
        outcome = results[0][1].outcome if results else None
        if undo is not None and outcome is not Outcome.APPLIED:
            undo()  # a heartbeat the machine did not take says nothing
        allocation = event.kind == "remote_blocks" and side == "send"
        if allocation and outcome in _UNTAKEN:
            self._reused_ids.unanswered_allocation(event.transfer_id, event.decode_rank)
        if event.kind == "release" and outcome is Outcome.LATE and self._ended_verdicts:
            self._ended_verdicts.answer_release(event.transfer_id, event.consumer_rank)
        self._log_outcome(outcome, event, message, delivery)
        # Only an allocation the machine stored: a duplicate, or one an ending transfer
        # ignored, is posted to by nothing.
        if allocation and any(
            done is event and result.outcome is Outcome.APPLIED for done, result in results or ()
        ):
            self._prepare(event.transfer_id, event.block_ids)

    def on_send_failure(self, failure: SendFailure) -> None:
        """A message this rank sent could not go out: its transfer's machine hears so."""
        if failure.transfer_id is None:
            return
        for side, driver in self._drivers.items():
            if driver.table.get(failure.transfer_id) is not None:
                self._dispatch(
                    side,
                    events.notify_failed(
                        failure.transfer_id,
                        self._parts.clock(),
                        f"{failure.kind}: {failure.reason}",
                    ),
                )
                return

    def _log_outcome(self, outcome, event, message, delivery: Delivery) -> None:
        now = self._parts.clock()
        if outcome is Outcome.FORGED and self._forged_log.allow(now):
            log.warning(
                "vllm.message_forged",
                kind=event.kind,
                transfer_id=event.transfer_id,
                sender=delivery.source,
                why="the transfer takes messages only from the peer its request named",
            )
        elif (
            outcome is Outcome.APPLIED
            and type(message) is WriteFailed
            and self._parts.failure_log.allow(now)
        ):
            log.warning(
                "vllm.peer_failed_transfer",
                transfer_id=event.transfer_id,
                reason=message.reason or "",
                writes_stopped=message.writes_stopped,
            )

    def _writers_match(self, event: Any) -> Any:
        """D, WRITE: a write_done saying P has another number of ranks writing into this D rank
        than D waits for (D's request named another ``remote_tp_size``) cannot prove D's
        blocks whole: D would report them loaded with other ranks' heads never written. It
        becomes that writer's write_failed (its writes landed, so they stopped)."""
        if event.kind != "write_done" or "receive" not in self._drivers:
            return event
        info = self._parts.directory.get(event.transfer_id)
        if info is None or info.peer is None:
            return event
        expected = len(self._parts.topology.peer_ranks(info.peer))
        if event.num_writers == expected:
            return event
        log.warning(
            "vllm.writer_count_mismatch",
            transfer_id=event.transfer_id,
            writers=event.num_writers,
            expected=expected,
            why="P's TP size differs from the remote_tp_size D's request named",
        )
        return events.write_failed(
            event.transfer_id,
            event.time,
            f"{event.num_writers} P ranks write, D expected {expected}",
            True,
            event.producer_rank,
            source=event.source,
        )

    def _side_of(self, kind: str) -> str | None:
        for side, driver in self._drivers.items():
            if kind in driver.table.spec.events:
                return side
        return None

    def _note_reply_address(self, message, delivery: Delivery):
        """READ P: where a heartbeat's sender wants its lease grants, noted before the
        dispatch whose grant needs it; returns how to take the note back, or None."""
        if (
            type(message) is not Heartbeat
            or message.reply_port is None
            or not delivery.peer.address
        ):
            return None
        info = self._parts.directory.get(message.transfer_id)
        rank = message.consumer_rank if message.consumer_rank is not None else 0
        if info is None or (
            rank not in info.reply_to and len(info.reply_to) >= MAX_REPLY_ADDRESSES
        ):
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
