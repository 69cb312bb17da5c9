"""Inlining rewrites a binding for a step only where the result means the same."""

from __future__ import annotations

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
    assert inlined.lines == ["value_plain_guard = ev.layer"]
    assert inlined.test.startswith("(type(value_plain_guard) is int and value_plain_guard < 64 and")
    assert "value_plain_guard < LIMIT" in inlined.test
    assert bound["LIMIT"] == 10


def test_event_fields_read_up_front_replace_attribute_reads():
    _, bind = _names()
    inlined = inline_guard(plain_guard, bind, {"max_layers": 64}, {}, frozenset({"layer"}))
    assert inlined.lines == ["value_plain_guard = ev_layer"]


def test_a_plain_action_keeps_its_statements():
    _, bind = _names()
    inlined = inline_action(plain_action, bind, {}, {})
    assert inlined.lines[:2] == ["bit_plain_action = 1 << ev.layer", "tx.scheduled |= bit_plain_action"]
    assert inlined.lines[2].startswith("for x_plain_action in range(2):")


def test_bindings_that_cannot_be_inlined_exactly_are_called_instead():
    _, bind = _names()
    for fn in (early_return, with_comprehension, with_default):
        assert inline_action(fn, bind, {}, {}) is None, fn.__name__

    def closure(record, event):
        return event.layer == LIMIT + captured
    captured = 1
    assert inline_guard(closure, bind, {}, {}) is None
