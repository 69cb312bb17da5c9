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


@pytest.mark.parametrize(
    "source, values, expected",
    [
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
    ],
)
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


@pytest.mark.parametrize(
    "source, construct",
    [
        ("posted.__class__", "Attribute"),
        ("items[0] == 1", "Subscript"),
        ("[x for x in items]", "ListComp"),
        ("lambda: 1", "Lambda"),
        ("{1: 2}", "Dict"),
        ("(posted := 1)", "NamedExpr"),
        ("f'{posted}'", "JoinedStr"),
    ],
)
def test_refuses_constructs_outside_the_language(source, construct):
    with pytest.raises(ExpressionError) as info:
        compile_predicate(source, FIELDS)
    message = str(info.value)
    assert repr(source) in message
    assert f"uses {construct}, which is not allowed" in message
    assert ", ".join(sorted(FUNCTIONS)) in message


@pytest.mark.parametrize(
    "source",
    [
        "__import__('os')",
        "eval('1')",
        "open('/etc/passwd')",
        "popcount(posted, base=2)",
        "posted()",
    ],
)
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


# -- bounds: checked before anything recurses ----------------------------------------------


def test_refuses_an_expression_over_the_length_bound_before_parsing():
    with pytest.raises(ExpressionError, match="100005 characters long; at most 1000"):
        compile_predicate(" + ".join(["posted"] * 100_000)[:100_000] + " == 0", FIELDS)


def test_refuses_deep_nesting():
    with pytest.raises(ExpressionError, match="nested deeper than 32 levels"):
        compile_predicate("not " * 40 + "flag", FIELDS)


def test_refuses_too_many_parts():
    with pytest.raises(ExpressionError, match="more than 256 parts"):
        compile_predicate("delta" + " < delta" * 120, FIELDS)


@pytest.mark.parametrize(
    "source, words",
    [
        ("posted == " + "9" * 30, "below 2**63"),
        ("posted == 1e400", "not finite"),
        ("posted == 1j", "1j (complex) is not allowed"),
        ("posted == b'x'", "(bytes)"),
        ("posted == ...", "(ellipsis)"),
        ("(1 << 70000) & posted == 0", "a constant shift must be in [0, 65536)"),
        ("popcount() == 0", "popcount takes exactly one argument, got 0"),
    ],
)
def test_refuses_constants_and_calls_out_of_bounds(source, words):
    with pytest.raises(ExpressionError) as info:
        compile_predicate(source, FIELDS)
    assert words in str(info.value)


# -- static types ---------------------------------------------------------------------------

TYPES = {
    "scheduled": "bitmap",
    "posted": "bitmap",
    "num_posted": "int",
    "flag": "bool",
    "items": "object",
    "delta": "float",
    "reason": "str",
}


@pytest.mark.parametrize(
    "source",
    [
        "num_posted == popcount(posted) and posted & ~scheduled == 0",
        "len(items) >= 0 and len(reason) < 10 and items is not None",
        "abs(delta) <= 2.5 and abs(num_posted) < 3 and -delta < 1",
        "reason == 'x' or reason + 'y' != 'z' or reason < 'b'",
        "(1 if flag else 0) + num_posted * 2 - delta >= 0",
        "(flag or num_posted) + 1 > 0",
    ],
)
def test_well_typed_expressions_pass_the_type_check(source):
    compile_predicate(source, TYPES, types=TYPES)


@pytest.mark.parametrize(
    "source, words",
    [
        (
            "popcount(reason) == 0",
            "popcount(reason) takes an int, bitmap or bool, but reason is a str",
        ),
        ("popcount(delta) == 0", "but delta is a float"),
        ("len(num_posted) == 0", "len(num_posted) takes a str or object, but num_posted is an int"),
        ("abs(flag) == 0", "abs(flag) takes an int or float, but flag is a bool"),
        ("abs(reason + 'x') == 0", "but (reason + 'x') is a str"),
        ("~delta == 0", "~delta takes an int, bitmap or bool, but delta is a float"),
        ("reason * 2 == ''", "reason * 2 combines str and int"),
        ("items & 1 == 0", "items & 1 combines object and int"),
        ("num_posted < reason", "num_posted < reason compares int and str; < takes two numbers"),
        ("items > 0", "items > 0 compares object and int"),
        ("reason != 1", "compares str and int, which are never equal"),
        ("num_posted == None", "test for None with 'is None'"),
        ("flag is True", "use 'is' only with None"),
        ("0 < num_posted < reason", "num_posted < reason compares int and str"),
    ],
)
def test_wrong_types_are_refused_naming_the_operation(source, words):
    with pytest.raises(ExpressionError) as info:
        compile_predicate(source, TYPES, types=TYPES)
    assert words in str(info.value)
    assert repr(source) in str(info.value)


def test_without_types_nothing_is_type_checked():
    check = compile_predicate("len(items) == 0", FIELDS)
    assert check(ctx(items=[]))
