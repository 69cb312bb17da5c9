"""Guards and actions of ``specs/read_consumer.yaml`` (the READ-mode decode side).

Every function is a small, pure step over the transfer's context, touching only the
fields the spec declares for it. Layer sets are bitmaps; the lease is one number on D's
clock, set only from a grant that answers the last heartbeat, so it never overstates
what P promised.
"""

from __future__ import annotations

import math

from ..runtime.bindings import Bindings
from ..runtime.declared import emits
from .bitmaps import layer_indices
from .common import bind_end_reasons
from .decode_reports import bind_decode_reports, quarantining
from .layer_transfers import bind_layer_transfers

bindings = Bindings("read_consumer")
bind_decode_reports(bindings)
bind_layer_transfers(bindings)


# -- guards -------------------------------------------------------------------------------


@bindings.guard
def valid_setup(tx, ev) -> bool:
    layers = ev.num_layers
    return (
        type(layers) is int
        and 1 <= layers <= tx.max_layers
        and isinstance(ev.remote_block_ids, (list, tuple))
        and len(ev.remote_block_ids) > 0
    )


@bindings.guard
def grant_for_last_heartbeat(tx, ev) -> bool:
    lease = ev.lease_s
    return (
        ev.seq == tx.heartbeat_seq
        and isinstance(lease, (int, float))
        and not isinstance(lease, bool)
        and math.isfinite(lease)
        and lease >= 0
    )


@bindings.guard
def set_up(tx, ev) -> bool:
    return tx.handshake_done and tx.lease_until > 0


@bindings.guard
def can_read(tx, ev) -> bool:
    return tx.reads_wanted and ev.time + tx.read_timeout_s + tx.lease_margin_s < tx.lease_until


@bindings.guard
def lease_at_risk(tx, ev) -> bool:
    return ev.time + tx.renew_interval_s + tx.lease_margin_s >= tx.lease_until


@bindings.guard
def all_read(tx, ev) -> bool:
    return tx.failed == 0 and tx.settled == tx.posted and tx.posted.bit_count() == tx.num_layers


@bindings.guard
def quiet_request_finished(tx, ev) -> bool:
    return tx.settled == tx.posted and tx.request_finished


@bindings.guard
def quiet(tx, ev) -> bool:
    return tx.settled == tx.posted


# -- actions ------------------------------------------------------------------------------


@bindings.action
def init_transfer(tx, ev, out) -> None:
    tx.num_layers = ev.num_layers
    tx.remote_block_ids = ev.remote_block_ids
    tx.heartbeat_seq = 1
    tx.heartbeat_sent_at = ev.time
    out.append(emits.request_handshake(tx.transfer_id))
    out.append(emits.send_heartbeat(tx.transfer_id, seq=1))


@bindings.action
def note_handshake(tx, ev, out) -> None:
    tx.handshake_done = True


@bindings.action
def extend_lease(tx, ev, out) -> None:
    # P renewed when the heartbeat reached it, after D sent it: P holds at least this long.
    tx.lease_until = max(tx.lease_until, tx.heartbeat_sent_at + ev.lease_s)


@bindings.action
def want_reads(tx, ev, out) -> None:
    tx.reads_wanted = True


@bindings.action
def post_reads(tx, ev, out) -> None:
    wanted = (1 << tx.num_layers) - 1
    waiting = wanted & ~tx.posted
    tx.posted |= waiting
    for layer in layer_indices(waiting):
        out.append(emits.post_read(tx.transfer_id, layer=layer, block_ids=tx.remote_block_ids))


@bindings.action
def renew_lease(tx, ev, out) -> None:
    tx.heartbeat_seq += 1
    tx.heartbeat_sent_at = ev.time
    out.append(emits.send_heartbeat(tx.transfer_id, seq=tx.heartbeat_seq))


@bindings.action
def count_read(tx, ev, out) -> None:
    tx.settled |= 1 << ev.layer


@bindings.action
def count_read_failure(tx, ev, out) -> None:
    bit = 1 << ev.layer
    tx.settled |= bit
    tx.failed |= bit
    if not tx.end_reason:
        tx.end_reason = "read_failed"


@bindings.action
def abandon_in_flight(tx, ev, out) -> None:
    in_flight = tx.posted & ~tx.settled
    if in_flight:
        out.append(emits.abandon_reads(tx.transfer_id, layers=layer_indices(in_flight)))


bind_end_reasons(
    bindings,
    end_setup_failed="setup_failed",
    end_lease_at_risk="lease_at_risk",
    end_stalled="stalled",
)


@bindings.action
def tell_release(tx, ev, out) -> None:
    if tx.release_sent == 0:
        tx.release_sent = 1
        out.append(emits.send_release(tx.transfer_id, reason=tx.end_reason or "done"))


# A torn-down read may still write into D's blocks: nobody may use them again.
bindings.action(quarantining("quarantine", reason="reads_unconfirmed"))
