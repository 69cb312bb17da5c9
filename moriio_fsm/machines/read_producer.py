"""Guards and actions of ``specs/read_producer.yaml`` (the READ-mode prefill side).

Every function is a small, pure step over the transfer's context, touching only the
fields the spec declares for it. Consumer ranks are told apart by a bit each; a release
that gives no rank (an upstream D) is counted, so the quorum still completes.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings
from ..runtime.declared import emits
from .common import count_notify_failure, note_request_finished

bindings = Bindings("read_producer")
bindings.action(note_request_finished)
bindings.action(count_notify_failure)


@bindings.guard
def valid_consumer_count(tx, ev) -> bool:
    count = ev.consumer_tp_size
    return 1 <= count <= tx.max_consumers


@bindings.guard
def release_repeated(tx, ev) -> bool:
    rank = ev.consumer_rank
    return 0 <= rank < tx.max_consumers and (tx.released_by >> rank) & 1 == 1


@bindings.guard
def release_usable(tx, ev) -> bool:
    rank = ev.consumer_rank
    return -1 <= rank < tx.max_consumers and tx.releases < tx.consumer_tp_size


@bindings.guard
def all_released(tx, ev) -> bool:
    return tx.releases == tx.consumer_tp_size


@bindings.guard
def heartbeat_usable(tx, ev) -> bool:
    rank, seq = ev.consumer_rank, ev.seq
    return -1 <= rank < tx.max_consumers and type(seq) is int and seq >= 0


@bindings.action
def init_transfer(tx, ev, out) -> None:
    tx.consumer_tp_size = ev.consumer_tp_size


@bindings.action
def record_release(tx, ev, out) -> None:
    rank = ev.consumer_rank
    if rank < 0:
        tx.unranked_releases += 1
    else:
        tx.released_by |= 1 << rank
    tx.releases += 1


@bindings.action
def hold_under_lease(tx, ev, out) -> None:
    tx.request_finished = True
    tx.blocks_held += 1
    tx.held_at = ev.time
    out.append(emits.hold_for_reads(tx.transfer_id, lease_s=float(tx.lease_s)))


@bindings.action
def grant_lease(tx, ev, out) -> None:
    # The lease timer is pushed back by the spec (restart_on heartbeat); this says so to D,
    # promising no more than the hold has left.
    tx.heartbeats += 1
    granted = max(0.0, min(float(tx.lease_s), tx.held_at + tx.max_hold_s - ev.time))
    out.append(
        emits.send_lease_granted(
            tx.transfer_id, consumer_rank=ev.consumer_rank, seq=ev.seq, lease_s=granted
        )
    )


@bindings.action
def free_blocks(tx, ev, out) -> None:
    tx.blocks_freed += 1
    out.append(
        emits.free_blocks(
            tx.transfer_id,
            reason="released" if tx.releases >= tx.consumer_tp_size else "lease_expired",
        )
    )
