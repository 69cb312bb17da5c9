"""Guards and effects of ``specs/write_producer.yaml`` (the WRITE-mode prefill side).

Every function here is a small, pure step over the transfer's context: layer sets
are bitmaps and counters, never sets of names. Which function runs when is decided
by the spec alone; these functions only say what a named step means. The per-layer
guards inline their range checks because they run once per layer per transfer.
"""

from __future__ import annotations

from ..runtime.events import Effect
from .binding import Bindings

bindings = Bindings("write_producer")


def _layers(bitmap: int) -> tuple[int, ...]:
    """The set bits of ``bitmap`` as ascending layer indices."""
    out = []
    while bitmap:
        low = bitmap & -bitmap
        out.append(low.bit_length() - 1)
        bitmap ^= low
    return tuple(out)


def _post(t, layers: tuple[int, ...], bitmap: int, out: list) -> None:
    t.posted |= bitmap
    t.num_posted += len(layers)
    out.append(Effect(t.transfer_id, "post_writes",
                      {"layers": layers, "block_ids": t.remote_block_ids,
                       "decode_rank": t.decode_rank}))


# -- guards -------------------------------------------------------------------------------

@bindings.guard
def valid_writer_count(t, ev) -> bool:
    count = ev.data.get("num_writers", 1)
    return type(count) is int and count >= 1


@bindings.guard
def new_layer_allocation_known(t, ev) -> bool:
    layer = ev.data.get("layer")
    return (t.has_allocation and type(layer) is int and 0 <= layer < t.max_layers
            and not (t.scheduled >> layer) & 1)


@bindings.guard
def layer_is_new(t, ev) -> bool:
    layer = ev.data.get("layer")
    return (type(layer) is int and 0 <= layer < t.max_layers
            and not (t.scheduled >> layer) & 1)


@bindings.guard
def layer_already_scheduled(t, ev) -> bool:
    layer = ev.data.get("layer")
    return (type(layer) is int and 0 <= layer < t.max_layers
            and (t.scheduled >> layer) & 1 == 1)


@bindings.guard
def layer_in_flight(t, ev) -> bool:
    layer = ev.data.get("layer")
    return (type(layer) is int and 0 <= layer < t.max_layers
            and ((t.posted & ~t.settled) >> layer) & 1 == 1)


@bindings.guard
def layer_already_settled(t, ev) -> bool:
    layer = ev.data.get("layer")
    return (type(layer) is int and 0 <= layer < t.max_layers
            and (t.settled >> layer) & 1 == 1)


@bindings.guard
def allocation_known(t, ev) -> bool:
    return t.has_allocation


@bindings.guard
def awaiting_allocation(t, ev) -> bool:
    return not t.has_allocation


@bindings.guard
def all_writes_succeeded(t, ev) -> bool:
    return (t.has_allocation and t.num_failed == 0
            and t.num_completed == t.writes_expected)


@bindings.guard
def local_request_finished(t, ev) -> bool:
    return t.request_finished


@bindings.guard
def quiet_after_release(t, ev) -> bool:
    return t.end_reason == "released" and t.settled == t.posted


@bindings.guard
def nothing_in_flight(t, ev) -> bool:
    return t.settled == t.posted


# -- effects ------------------------------------------------------------------------------

@bindings.effect
def init_transfer(t, ev, out) -> None:
    t.num_writers = ev.data.get("num_writers", 1)


@bindings.effect
def store_allocation(t, ev, out) -> None:
    t.remote_block_ids = ev.data["block_ids"]
    t.decode_rank = ev.data["decode_rank"]
    t.has_allocation = True
    waiting = t.scheduled & ~t.posted
    if waiting:
        _post(t, _layers(waiting), waiting, out)


@bindings.effect
def schedule_layer(t, ev, out) -> None:
    t.scheduled |= 1 << ev.data["layer"]
    t.num_scheduled += 1


@bindings.effect
def post_layer(t, ev, out) -> None:
    layer = ev.data["layer"]
    _post(t, (layer,), 1 << layer, out)


@bindings.effect
def fix_expected(t, ev, out) -> None:
    t.writes_expected = t.num_scheduled


@bindings.effect
def count_completion(t, ev, out) -> None:
    t.settled |= 1 << ev.data["layer"]
    t.num_completed += 1


@bindings.effect
def count_failure(t, ev, out) -> None:
    t.settled |= 1 << ev.data["layer"]
    t.num_failed += 1


@bindings.effect
def abandon_in_flight(t, ev, out) -> None:
    in_flight = t.posted & ~t.settled
    if in_flight:
        out.append(Effect(t.transfer_id, "abandon_writes", {"layers": _layers(in_flight)}))


@bindings.effect
def settle_abandoned(t, ev, out) -> None:
    in_flight = t.posted & ~t.settled
    t.settled |= in_flight
    t.num_failed += in_flight.bit_count()


@bindings.effect
def mark_request_finished(t, ev, out) -> None:
    t.request_finished = True


@bindings.effect
def send_write_done(t, ev, out) -> None:
    t.write_done_sent += 1
    out.append(Effect(t.transfer_id, "send_write_done",
                      {"num_writers": t.num_writers, "decode_rank": t.decode_rank}))


@bindings.effect
def send_write_failed(t, ev, out) -> None:
    # decode_rank is -1 when D's allocation never arrived: the driver then tells every
    # D rank of the transfer, as D's release goes to every P rank.
    t.write_failed_sent += 1
    out.append(Effect(t.transfer_id, "send_write_failed",
                      {"reason": t.end_reason, "decode_rank": t.decode_rank}))


@bindings.effect
def free_blocks(t, ev, out) -> None:
    t.blocks_freed += 1
    out.append(Effect(t.transfer_id, "free_blocks", {"reason": t.end_reason or "completed"}))


#: How a transfer may end: end reason -> (guard that the local request finished while
#: ending for that reason, effect that records the reason). One factory builds each pair.
_ENDINGS = {"failed": ("finished_after_failure", "end_failed"),
            "aborted": ("finished_after_abort", "end_aborted"),
            "expired": ("finished_after_expiry", "end_expired"),
            "released": ("finished_after_release", "end_released")}


def _bind_ending(reason: str, guard_name: str, effect_name: str) -> None:
    def finished(t, ev) -> bool:
        return t.end_reason == reason and t.request_finished

    def record_reason(t, ev, out) -> None:
        t.end_reason = reason

    finished.__name__ = finished.__qualname__ = guard_name
    record_reason.__name__ = record_reason.__qualname__ = effect_name
    bindings.guard(finished)
    bindings.effect(record_reason)


for _reason, (_guard_name, _effect_name) in _ENDINGS.items():
    _bind_ending(_reason, _guard_name, _effect_name)
