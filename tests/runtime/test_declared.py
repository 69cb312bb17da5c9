"""Declared event and effect kinds become classes, one meaning per kind everywhere."""

from __future__ import annotations

import msgspec
import pytest

from moriio_fsm.lang.errors import SpecError
from moriio_fsm.lang.loader import parse_spec
from moriio_fsm.machines import spec_path
from moriio_fsm.runtime.declared import (
    effect_class,
    emits,
    event_class,
    events,
    make_event,
    register_spec,
)
from moriio_fsm.runtime.events import Effect, Event


def test_an_event_class_has_the_declared_payload_in_order_and_source_by_keyword():
    ev = events.remote_blocks("tx-1", 1.5, [3, 4], 1, source="10.0.0.2#ab")
    assert isinstance(ev, Event) and ev.kind == "remote_blocks"
    assert (ev.block_ids, ev.decode_rank, ev.req_id, ev.source) == ([3, 4], 1, "", "10.0.0.2#ab")
    assert ev.data == {
        "block_ids": [3, 4],
        "decode_rank": 1,
        "req_id": "",
        "prompt_digest": "",
        "decode_dp_rank": -1,
    }
    assert events.release("tx-1", 0.0).consumer_tp_size == 1  # the declared default
    with pytest.raises(TypeError):
        events.remote_blocks("tx-1", 0.0, [3], 1, "req", "digest", 0, "extra")


def test_an_effect_class_has_exactly_the_declared_fields():
    effect = emits.post_write("tx-1", layer=2, block_ids=[9], decode_rank=0)
    assert isinstance(effect, Effect) and effect.kind == "post_write"
    assert effect.data == {"layer": 2, "block_ids": [9], "decode_rank": 0}
    assert effect == effect_class("post_write")("tx-1", 2, [9], 0)
    with pytest.raises(TypeError):
        emits.post_write("tx-1", layer=2, block_ids=[9])  # decode_rank missing


def test_events_and_effects_serialize_and_compare_by_value():
    ev = events.layer_scheduled("tx-1", 0.5, 3)
    assert msgspec.json.decode(msgspec.json.encode(ev), type=event_class("layer_scheduled")) == ev
    assert make_event("layer_scheduled", "tx-1", 0.5, {"layer": 3}) == ev


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(LookupError, match="no_such_kind.*layer_scheduled"):
        event_class("no_such_kind")
    with pytest.raises(AttributeError):
        _ = events._private


def test_a_second_spec_declaring_a_kind_with_other_fields_is_refused():
    text = (
        spec_path("write_producer")
        .read_text()
        .replace("payload: {layer: int}\n", "payload: {layer: str}\n", 1)
    )
    copy = parse_spec(text, "other.yaml")
    with pytest.raises(SpecError) as info:
        register_spec(copy)
    message = str(info.value)
    assert "other.yaml" in message and "layer_scheduled" in message
    assert "write_producer.yaml" in message and "one kind has one meaning" in message
