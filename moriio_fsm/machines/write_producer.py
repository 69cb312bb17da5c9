"""Guards and actions of ``specs/write_producer.yaml`` (the WRITE-mode prefill side).

Every function here is a small, pure step over the transfer's context: layer sets
are bitmaps and counters, never sets of names. Which function runs when is decided
by the spec alone; these functions only say what a named step means, touching only
the fields the spec declares for them. Payload fields arrive of their declared types
(every step checks that first), so guards check only ranges.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings
from ..runtime.declared import emits
from .bitmaps import layer_indices
from .common import bind_end_reasons, count_notify_failure, local_request_finished
from .layer_transfers import bind_layer_transfers

bindings = Bindings("write_producer")
bind_layer_transfers(bindings)
bindings.guard(local_request_finished)
bindings.action(count_notify_failure)


# -- guards -------------------------------------------------------------------------------


@bindings.guard
def valid_writer_count(tx, ev) -> bool:
    count = ev.num_writers
    return count >= 1


@bindings.guard
def new_layer_allocation_known(tx, ev) -> bool:
    layer = ev.layer
    return tx.has_allocation and 0 <= layer < tx.max_layers and not (tx.scheduled >> layer) & 1


@bindings.guard
def layer_is_new(tx, ev) -> bool:
    layer = ev.layer
    return 0 <= layer < tx.max_layers and not (tx.scheduled >> layer) & 1


@bindings.guard
def layer_already_scheduled(tx, ev) -> bool:
    layer = ev.layer
    return 0 <= layer < tx.max_layers and (tx.scheduled >> layer) & 1 == 1


@bindings.guard
def new_layers_allocation_known(tx, ev) -> bool:
    layers = ev.layers
    return (
        tx.has_allocation
        and 0 < layers
        and layers >> tx.max_layers == 0
        and layers & ~tx.scheduled != 0
    )


@bindings.guard
def layers_are_new(tx, ev) -> bool:
    layers = ev.layers
    return 0 < layers and layers >> tx.max_layers == 0 and layers & ~tx.scheduled != 0


@bindings.guard
def layers_already_scheduled(tx, ev) -> bool:
    layers = ev.layers
    return 0 < layers and layers >> tx.max_layers == 0 and layers & ~tx.scheduled == 0


@bindings.guard
def allocation_known(tx, ev) -> bool:
    return tx.has_allocation


@bindings.guard
def usable_allocation(tx, ev) -> bool:
    return ev.decode_rank >= 0


@bindings.guard
def allocation_from_another_engine(tx, ev) -> bool:
    theirs = ev.decode_dp_rank
    return theirs >= 0 and tx.decode_dp_rank >= 0 and theirs != tx.decode_dp_rank


@bindings.guard
def allocation_for_another_prompt(tx, ev) -> bool:
    theirs = ev.prompt_digest
    return bool(theirs) and bool(tx.prompt_digest) and theirs != tx.prompt_digest


@bindings.guard
def awaiting_allocation(tx, ev) -> bool:
    return not tx.has_allocation


@bindings.guard
def all_writes_succeeded(tx, ev) -> bool:
    # In 'sealed' no layer is added any more: every scheduled layer settled, none failed.
    # The comparison that is false until the last write comes first: it runs per write.
    return tx.settled == tx.scheduled and tx.failed == 0 and tx.has_allocation


@bindings.guard
def nothing_in_flight(tx, ev) -> bool:
    return tx.settled == tx.posted


# -- actions ------------------------------------------------------------------------------


@bindings.action
def init_transfer(tx, ev, out) -> None:
    tx.num_writers = ev.num_writers
    tx.prompt_digest = ev.prompt_digest
    tx.decode_dp_rank = ev.decode_dp_rank


@bindings.action
def store_allocation(tx, ev, out) -> None:
    tx.remote_block_ids = ev.block_ids
    tx.decode_rank = ev.decode_rank
    tx.has_allocation = True


@bindings.action
def post_waiting_layers(tx, ev, out) -> None:
    waiting = tx.scheduled & ~tx.posted
    tx.posted |= waiting
    for layer in layer_indices(waiting):
        out.append(
            emits.post_write(
                tx.transfer_id,
                layer=layer,
                block_ids=tx.remote_block_ids,
                decode_rank=tx.decode_rank,
            )
        )


@bindings.action
def schedule_layer(tx, ev, out) -> None:
    tx.scheduled |= 1 << ev.layer


@bindings.action
def schedule_layers(tx, ev, out) -> None:
    tx.scheduled |= ev.layers


@bindings.action
def post_layer(tx, ev, out) -> None:
    layer = ev.layer
    tx.posted |= 1 << layer
    out.append(
        emits.post_write(
            tx.transfer_id, layer=layer, block_ids=tx.remote_block_ids, decode_rank=tx.decode_rank
        )
    )


@bindings.action
def fix_expected(tx, ev, out) -> None:
    tx.writes_expected = tx.scheduled.bit_count()


@bindings.action
def count_completion(tx, ev, out) -> None:
    tx.settled |= 1 << ev.layer


@bindings.action
def count_failure(tx, ev, out) -> None:
    bit = 1 << ev.layer
    tx.settled |= bit
    tx.failed |= bit


@bindings.action
def abandon_in_flight(tx, ev, out) -> None:
    in_flight = tx.posted & ~tx.settled
    if in_flight:
        out.append(emits.abandon_writes(tx.transfer_id, layers=layer_indices(in_flight)))


@bindings.action
def mark_request_finished(tx, ev, out) -> None:
    tx.request_finished = True


@bindings.action
def tell_write_done(tx, ev, out) -> None:
    tx.write_done_sent += 1
    out.append(
        emits.send_write_done(
            tx.transfer_id, num_writers=tx.num_writers, decode_rank=tx.decode_rank
        )
    )


@bindings.action
def tell_write_failed(tx, ev, out) -> None:
    # decode_rank is -1 when D's allocation never arrived: the driver then tells every
    # D rank of the transfer, as D's release goes to every P rank.
    tx.write_failed_sent += 1
    out.append(
        emits.send_write_failed(
            tx.transfer_id, reason=tx.end_reason, decode_rank=tx.decode_rank, writes_stopped=True
        )
    )


# The repeats answer D's release and count nothing: the verdict is the one already sent.
# (Each action names its emit itself: the spec checker reads which emits an action makes.)
@bindings.action
def repeat_write_done(tx, ev, out) -> None:
    out.append(
        emits.send_write_done(
            tx.transfer_id, num_writers=tx.num_writers, decode_rank=tx.decode_rank
        )
    )


@bindings.action
def repeat_write_failed(tx, ev, out) -> None:
    out.append(
        emits.send_write_failed(
            tx.transfer_id, reason=tx.end_reason, decode_rank=tx.decode_rank, writes_stopped=True
        )
    )


@bindings.action
def quarantine(tx, ev, out) -> None:
    # The writes were asked to stop and nobody confirmed it: they may still land in D's
    # blocks and read from P's. Both sides must keep those blocks out of circulation.
    tx.write_failed_sent += 1
    tx.blocks_quarantined += 1
    out.append(
        emits.send_write_failed(
            tx.transfer_id, reason=tx.end_reason, decode_rank=tx.decode_rank, writes_stopped=False
        )
    )
    out.append(emits.quarantine_blocks(tx.transfer_id, reason="writes_unconfirmed"))


@bindings.action
def free_blocks(tx, ev, out) -> None:
    tx.blocks_freed += 1
    out.append(emits.free_blocks(tx.transfer_id, reason=tx.end_reason or "completed"))


# -- how an ending transfer records its reason, and knows it may hand the blocks back ----

bind_end_reasons(
    bindings,
    end_failed="failed",
    end_mismatched="prompt_mismatch",
    end_aborted="aborted",
    end_expired="expired",
    end_released="released",
)


@bindings.guard
def finished_after_failure(tx, ev) -> bool:
    return tx.end_reason in ("failed", "prompt_mismatch") and tx.request_finished


@bindings.guard
def finished_after_abort(tx, ev) -> bool:
    return tx.end_reason == "aborted" and tx.request_finished


@bindings.guard
def finished_after_expiry(tx, ev) -> bool:
    return tx.end_reason == "expired" and tx.request_finished


@bindings.guard
def finished_after_release(tx, ev) -> bool:
    return tx.end_reason == "released" and tx.request_finished
