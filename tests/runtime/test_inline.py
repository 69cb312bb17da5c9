"""Inlining rewrites a binding for a step only where the result means the same."""

from __future__ import annotations

from moriio_fsm.runtime.declared import emits
from moriio_fsm.runtime.inline import inline_action, inline_guard

LIMIT = 10


def _names():
    bound: dict = {}

    def bind(obj, name):
        bound[name] = obj
        return name

    return bound, bind


def plain_guard(record, event):
    value = event.layer
    return type(value) is int and value < record.max_layers and value < LIMIT


def plain_action(record, event, out):
    bit = 1 << event.layer
    record.scheduled |= bit
    for x in range(2):
        out.append(x)


def early_return(record, event, out):
    if event.layer:
        return
    record.scheduled = 1


def with_comprehension(record, event, out):
    record.scheduled = sum([1 for _ in range(3)])


def with_default(record, event, out=None):
    record.scheduled = 1


def test_a_plain_guard_is_rewritten_with_parameters_locals_globals_and_config():
    bound, bind = _names()
    inlined = inline_guard(plain_guard, bind, {"max_layers": 64}, {})
    assert inlined.lines == ["_value_plain_guard = ev.layer"]
    assert inlined.test.startswith(
        "(type(_value_plain_guard) is int and _value_plain_guard < 64 and"
    )
    # A plain value global is read live off its module; the module is bound once.
    assert "_value_plain_guard < _M_" in inlined.test and ".LIMIT" in inlined.test
    assert any(name.startswith("_M_") for name in bound)


def test_event_fields_read_up_front_replace_attribute_reads():
    _, bind = _names()
    inlined = inline_guard(plain_guard, bind, {"max_layers": 64}, {}, frozenset({"layer"}))
    # The copy of the event field is dropped: the step's ev_layer is read directly.
    assert inlined.lines == []
    assert inlined.test.startswith("(type(ev_layer) is int and ev_layer < 64")


def test_a_plain_action_keeps_its_statements():
    _, bind = _names()
    inlined = inline_action(plain_action, bind, {}, {})
    assert inlined.lines[:2] == [
        "_bit_plain_action = 1 << ev.layer",
        "tx.scheduled |= _bit_plain_action",
    ]
    assert inlined.lines[2].startswith("for _x_plain_action in range(2):")


def rebinds_a_parameter(record, event, out):
    record.scheduled = 1
    out = None  # noqa: F841 (rebinding a parameter is what makes this binding not inlinable)


def names_an_exception(record, event, out):
    try:
        int(event.error)
    except ValueError as problem:
        record.scheduled = 1 if problem else 0


def imports_something(record, event, out):
    import math

    record.scheduled = math.floor(1.5)


def reads_its_frame(record, event, out):
    record.scheduled = len(locals())


def test_bindings_that_cannot_be_inlined_exactly_are_called_instead():
    _, bind = _names()
    for fn in (
        early_return,
        with_comprehension,
        with_default,
        rebinds_a_parameter,
        names_an_exception,
        imports_something,
        reads_its_frame,
    ):
        assert inline_action(fn, bind, {}, {}) is None, fn.__name__

    def closure(record, event):
        return event.layer == LIMIT + captured

    captured = 1
    assert inline_guard(closure, bind, {}, {}) is None


def test_a_config_value_is_folded_only_where_the_literal_cannot_change_the_parse():
    _, bind = _names()
    folded = inline_guard(plain_guard, bind, {"max_layers": 64}, {})
    kept = inline_guard(plain_guard, bind, {"max_layers": -64}, {})
    assert "< 64" in folded.test and "tx.max_layers" not in folded.test
    assert "tx.max_layers" in kept.test


def emitting_out_of_order(record, event, out):
    out.append(emits.post_write(record.transfer_id, block_ids=None, layer=1, decode_rank=0))


def test_keyword_arguments_keep_their_order_unless_already_in_declared_order():
    from moriio_fsm.runtime.declared import effect_class

    _, bind = _names()
    classes = {"post_write": effect_class("post_write")}
    inlined = inline_action(emitting_out_of_order, bind, {}, classes)
    assert "block_ids=None, layer=1, decode_rank=0" in inlined.lines[0]
