"""Guards and actions of ``specs/write_consumer.yaml`` (the WRITE-mode decode side).

Every function is a small, pure step over the transfer's context, touching only the
fields the spec declares for it. Writers are told apart by their producer rank (a bit
each); a sender that gives no rank is counted, so an upstream P still completes a
transfer. Which function runs when is decided by the spec alone.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings
from ..runtime.declared import emits
from .common import bind_end_reasons
from .decode_reports import bind_decode_reports, quarantining

bindings = Bindings("write_consumer")
bind_decode_reports(bindings)


# -- guards -------------------------------------------------------------------------------


@bindings.guard
def valid_writer_count(tx, ev) -> bool:
    count = ev.num_writers
    return 1 <= count <= tx.max_writers


@bindings.guard
def has_blocks(tx, ev) -> bool:
    return len(ev.block_ids) > 0


@bindings.guard
def verdict_repeated(tx, ev) -> bool:
    rank = ev.producer_rank
    return 0 <= rank < tx.max_writers and ((tx.done_from | tx.failed_from) >> rank) & 1 == 1


@bindings.guard
def verdict_usable(tx, ev) -> bool:
    rank = ev.producer_rank
    return -1 <= rank < tx.max_writers and tx.verdicts < tx.num_writers


@bindings.guard
def unconfirmed(tx, ev) -> bool:
    return tx.writes_unconfirmed


@bindings.guard
def all_landed(tx, ev) -> bool:
    return tx.verdicts == tx.num_writers and tx.failed_from == 0 and tx.unranked_failed == 0


@bindings.guard
def some_writer_failed(tx, ev) -> bool:
    return tx.failed_from != 0 or tx.unranked_failed != 0


@bindings.guard
def all_stopped_request_finished(tx, ev) -> bool:
    return tx.verdicts == tx.num_writers and tx.request_finished


@bindings.guard
def all_stopped_all_landed(tx, ev) -> bool:
    return tx.verdicts == tx.num_writers and tx.failed_from == 0 and tx.unranked_failed == 0


@bindings.guard
def all_stopped(tx, ev) -> bool:
    return tx.verdicts == tx.num_writers


# -- actions ------------------------------------------------------------------------------


@bindings.action
def init_transfer(tx, ev, out) -> None:
    tx.num_writers = ev.num_writers


@bindings.action
def announce_blocks(tx, ev, out) -> None:
    tx.block_ids = ev.block_ids
    out.append(emits.send_remote_blocks(tx.transfer_id, block_ids=ev.block_ids, req_id=ev.req_id))


@bindings.action
def record_done(tx, ev, out) -> None:
    rank = ev.producer_rank
    if rank < 0:
        tx.unranked_done += 1
    else:
        tx.done_from |= 1 << rank
    tx.verdicts += 1


@bindings.action
def record_failure(tx, ev, out) -> None:
    rank = ev.producer_rank
    if rank < 0:
        tx.unranked_failed += 1
    else:
        tx.failed_from |= 1 << rank
    tx.verdicts += 1
    if not ev.writes_stopped:
        tx.writes_unconfirmed = True
    if not tx.end_reason:
        tx.end_reason = "failed"


@bindings.action
def tell_release(tx, ev, out) -> None:
    if tx.release_sent == 0:
        tx.release_sent = 1
        out.append(emits.send_release(tx.transfer_id, reason=tx.end_reason or "failed"))


@bindings.guard
def may_repeat_release(tx, ev) -> bool:
    return tx.release_repeats < tx.max_release_repeats


@bindings.action
def repeat_release(tx, ev, out) -> None:
    tx.release_repeats += 1
    out.append(emits.send_release(tx.transfer_id, reason=tx.end_reason or "failed"))


bind_end_reasons(bindings, end_timed_out="timeout", end_finished="finished", end_unsent="unsent")


# A write may still land in these blocks: nobody may use them again, and a request
# still waiting for them must not wait forever either.
bindings.action(quarantining("quarantine", reason="writes_unconfirmed"))
# Silence proves nothing: a writer that never heard the release may still write.
bindings.action(quarantining("give_up_waiting", reason="safety_timeout"))
