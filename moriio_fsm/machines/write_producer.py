"""Guards and effects of ``specs/write_producer.yaml`` (the WRITE-mode prefill side).

Every function here is a small, pure step over the transfer's context: layer sets
are bitmaps and counters, never sets of names. Which function runs when is decided
by the spec alone; these functions only say what a named step means.
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


def _layer_bit(t, ev) -> int:
    """The event's layer as a bit, or 0 when the layer is missing or out of range."""
    layer = ev.data.get("layer")
    if type(layer) is not int or layer < 0 or layer >= t.max_layers:
        return 0
    return 1 << layer


# -- guards -------------------------------------------------------------------------------

@bindings.guard
def layer_is_new(t, ev) -> bool:
    # Inlined range check: this guard runs once per layer per transfer.
    layer = ev.data.get("layer")
    return (type(layer) is int and 0 <= layer < t.max_layers
            and not (t.scheduled >> layer) & 1)


@bindings.guard
def layer_already_scheduled(t, ev) -> bool:
    bit = _layer_bit(t, ev)
    return bit != 0 and bool(t.scheduled & bit)


@bindings.guard
def layer_in_flight(t, ev) -> bool:
    # Inlined range check: this guard runs once per layer per transfer.
    layer = ev.data.get("layer")
    return (type(layer) is int and 0 <= layer < t.max_layers
            and ((t.posted & ~t.settled) >> layer) & 1 == 1)


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


#: How a draining transfer may end: end reason -> (guard that it may end now, effect
#: that records the reason). The spec names each; one factory builds each pair.
_ENDINGS = {"failed": ("settled_after_failure", "end_failed"),
            "aborted": ("settled_after_abort", "end_aborted"),
            "expired": ("settled_after_expiry", "end_expired"),
            "released": ("settled_after_release", "end_released")}


def _bind_ending(reason: str, guard_name: str, effect_name: str) -> None:
    def settled(t, ev) -> bool:
        return t.end_reason == reason and t.settled == t.posted and t.request_finished

    def record_reason(t, ev, out) -> None:
        t.end_reason = reason

    settled.__name__ = settled.__qualname__ = guard_name
    record_reason.__name__ = record_reason.__qualname__ = effect_name
    bindings.guard(settled)
    bindings.effect(record_reason)


for _reason, (_guard_name, _effect_name) in _ENDINGS.items():
    _bind_ending(_reason, _guard_name, _effect_name)


# -- effects ------------------------------------------------------------------------------

@bindings.effect
def init_transfer(t, ev, out) -> None:
    num_writers = ev.data.get("num_writers", 1)
    if type(num_writers) is not int or num_writers < 1:
        raise ValueError(f"transfer {t.transfer_id!r}: create needs num_writers >= 1, "
                         f"got {num_writers!r}")
    t.num_writers = num_writers


@bindings.effect
def store_allocation(t, ev, out) -> None:
    t.remote_block_ids = ev.data["block_ids"]
    t.decode_rank = ev.data.get("decode_rank", 0)
    t.has_allocation = True
    waiting = t.scheduled & ~t.posted
    if waiting:
        layers = _layers(waiting)
        t.posted |= waiting
        t.num_posted += len(layers)
        out.append(Effect(t.transfer_id, "post_writes",
                          {"layers": layers, "block_ids": t.remote_block_ids,
                           "decode_rank": t.decode_rank}))


@bindings.effect
def schedule_layer(t, ev, out) -> None:
    layer = ev.data["layer"]
    bit = 1 << layer
    t.scheduled |= bit
    t.num_scheduled += 1
    if t.has_allocation:
        t.posted |= bit
        t.num_posted += 1
        out.append(Effect(t.transfer_id, "post_writes",
                          {"layers": (layer,), "block_ids": t.remote_block_ids,
                           "decode_rank": t.decode_rank}))


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
def mark_request_finished(t, ev, out) -> None:
    t.request_finished = True


@bindings.effect
def send_write_done(t, ev, out) -> None:
    t.write_done_sent += 1
    out.append(Effect(t.transfer_id, "send_write_done",
                      {"num_writers": t.num_writers, "decode_rank": t.decode_rank}))


@bindings.effect
def send_write_failed(t, ev, out) -> None:
    t.write_failed_sent += 1
    out.append(Effect(t.transfer_id, "send_write_failed",
                      {"reason": t.end_reason, "decode_rank": t.decode_rank}))


@bindings.effect
def abandon_in_flight(t, ev, out) -> None:
    in_flight = t.posted & ~t.settled
    if in_flight:
        layers = _layers(in_flight)
        t.settled |= in_flight
        t.num_failed += len(layers)
        out.append(Effect(t.transfer_id, "abandon_writes", {"layers": layers}))


@bindings.effect
def free_blocks(t, ev, out) -> None:
    t.blocks_freed += 1
    out.append(Effect(t.transfer_id, "free_blocks", {"reason": t.end_reason or "completed"}))
