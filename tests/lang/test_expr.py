"""``compile_predicate``: what invariant expressions compute, and what they refuse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moriio_fsm.lang.expr import FUNCTIONS, ExpressionError, compile_predicate

FIELDS = ("scheduled", "posted", "num_posted", "flag", "items", "delta")


def ctx(**values):
    base = dict(scheduled=0, posted=0, num_posted=0, flag=False, items=[], delta=0)
    base.update(values)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("source, values, expected", [
    ("num_posted == popcount(posted)", dict(posted=0b1011, num_posted=3), True),
    ("num_posted == popcount(posted)", dict(posted=0b1011, num_posted=2), False),
    ("posted & ~scheduled == 0", dict(scheduled=0b111, posted=0b101), True),
    ("posted & ~scheduled == 0", dict(scheduled=0b011, posted=0b101), False),
    ("(posted | scheduled) ^ scheduled == 0b100", dict(scheduled=0b011, posted=0b101), True),
    ("(1 << 3) & scheduled and scheduled >> 3 == 1", dict(scheduled=0b1000), True),
    ("num_posted == 0 or flag", dict(num_posted=2, flag=True), True),
    ("num_posted == 0 or flag", dict(num_posted=2, flag=False), False),
    ("num_posted >= 1 and not flag", dict(num_posted=1, flag=False), True),
    ("len(items) == num_posted", dict(items=[4, 5], num_posted=2), True),
    ("abs(delta) <= 2", dict(delta=-2), True),
    ("abs(delta) <= 2", dict(delta=-3), False),
    ("(1 if flag else 0) + num_posted * 2 - 1 == 3", dict(flag=True, num_posted=1.5), True),
    ("items is not None", dict(items=None), False),
])
def test_evaluates_on_an_object_with_attributes(source, values, expected):
    assert bool(compile_predicate(source, FIELDS)(ctx(**values))) is expected


def test_reads_fields_when_called_not_when_compiled():
    check = compile_predicate("num_posted == popcount(posted)", FIELDS)
    live = ctx(posted=0b1, num_posted=1)
    assert check(live)
    live.posted = 0b11
    assert not check(live)
    live.num_posted = 2
    assert check(live)


def test_popcount_counts_bits_of_large_bitmaps():
    assert compile_predicate("popcount(posted) == 4096", FIELDS)(ctx(posted=(1 << 4096) - 1))


@pytest.mark.parametrize("source, construct", [
    ("posted.__class__", "Attribute"),
    ("items[0] == 1", "Subscript"),
    ("[x for x in items]", "ListComp"),
    ("lambda: 1", "Lambda"),
    ("{1: 2}", "Dict"),
    ("(posted := 1)", "NamedExpr"),
    ("f'{posted}'", "JoinedStr"),
])
def test_refuses_constructs_outside_the_language(source, construct):
    with pytest.raises(ExpressionError) as info:
        compile_predicate(source, FIELDS)
    message = str(info.value)
    assert repr(source) in message
    assert f"uses {construct}, which is not allowed" in message
    assert ", ".join(sorted(FUNCTIONS)) in message


@pytest.mark.parametrize("source", [
    "__import__('os')",
    "eval('1')",
    "open('/etc/passwd')",
    "popcount(posted, base=2)",
    "posted()",
])
def test_refuses_calls_to_anything_but_the_listed_functions(source):
    with pytest.raises(ExpressionError, match="calls something other than abs, len, popcount"):
        compile_predicate(source, FIELDS)


def test_refuses_names_that_are_not_fields():
    with pytest.raises(ExpressionError) as info:
        compile_predicate("postd == 0", FIELDS)
    message = str(info.value)
    assert "names 'postd', which is not a context field" in message
    assert "known fields: delta, flag, items, num_posted, posted, scheduled" in message


@pytest.mark.parametrize("source", ["__builtins__", "__import__ == 0", "True == __class__"])
def test_refuses_dunder_names(source):
    with pytest.raises(ExpressionError, match="which is not a context field"):
        compile_predicate(source, FIELDS)


def test_refuses_invalid_syntax():
    with pytest.raises(ExpressionError, match="invalid expression 'posted =='"):
        compile_predicate("posted ==", FIELDS)


def test_refuses_statements():
    with pytest.raises(ExpressionError, match="invalid expression"):
        compile_predicate("import os", FIELDS)


def test_is_an_error_a_spec_loader_can_catch_as_value_error():
    assert issubclass(ExpressionError, ValueError)
