"""A small, safe expression language for spec invariants.

Invariants are Python-syntax boolean expressions over context field names, e.g.
``"posted & ~scheduled == 0"``. Only arithmetic, bitwise, comparison and boolean
operators, constants, field names and the functions in ``FUNCTIONS`` are allowed;
anything else is refused at load time with the offending construct named.

Rules: an expression is bounded before it is parsed (length) and before it is compiled
(depth, node count, constants), so no input can exhaust the stack or memory; given the
fields' types, every operator and call is type-checked statically, so a wrong-typed
invariant fails at load time, not in the middle of a run.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import MoriioFsmError


def _popcount(value: int) -> int:
    return int(value).bit_count()


FUNCTIONS: dict[str, Callable[..., Any]] = {"popcount": _popcount, "len": len, "abs": abs}

#: Bounds on one expression. The shipped invariants stay far below them (the longest is
#: under 200 characters, 60 nodes, depth 10); they exist so that parsing, checking and
#: compiling one expression is cheap whatever the spec file holds.
MAX_SOURCE_CHARS = 1000
MAX_NODES = 256
MAX_DEPTH = 32
#: Integer constants stay within a signed 64-bit range, and a constant left shift within
#: this many bits: ``1 << (1 << 62)`` would try to allocate exabytes at run time.
MAX_INT = 2**63
MAX_SHIFT = 1 << 16

_ALLOWED_NODES = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.Invert,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.BitAnd,
    ast.BitOr,
    ast.BitXor,
    ast.LShift,
    ast.RShift,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Is,
    ast.IsNot,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Call,
    ast.IfExp,
)


class ExpressionError(MoriioFsmError, ValueError):
    """The expression is not valid Python or uses a construct or name not allowed."""


def show_int(value: int) -> str:
    """An integer for a message: a long one is cut, with its digit count, so a message
    stays one readable line."""
    try:
        text = str(value)
    except ValueError:  # over Python's 4300-digit conversion limit
        return "an integer of more than 4300 digits"
    if len(text) <= 24:
        return text
    return f"{text[:24]}... ({len(text.lstrip('-'))} digits)"


def compile_predicate(
    source: str, names: Iterable[str], types: Mapping[str, str] | None = None
) -> Callable[[Any], bool]:
    """Compile ``source`` into ``f(obj) -> bool`` that reads names as attributes of obj.

    ``types`` maps each name to its context type (``int``, ``bool``, ``float``, ``str``,
    ``bitmap``, ``object``); when given, operators and calls are type-checked. Raises
    ``ExpressionError`` naming the first construct, name, bound or type that is wrong.
    """
    known = set(names)
    tree = _parse(source)
    _check_structure(tree, source, known)
    if types is not None:
        _TypeChecker(source, types).type_of(tree.body)

    # Rewrite bare field names into attribute reads of the single argument so the
    # compiled function works on any object carrying the context as attributes.
    # (Recursive, but the depth was bounded above.)
    class _Bind(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in FUNCTIONS:
                return node
            return ast.copy_location(
                ast.Attribute(
                    value=ast.Name(id="_ctx", ctx=ast.Load()), attr=node.id, ctx=ast.Load()
                ),
                node,
            )

    body = _Bind().visit(tree).body
    lam = ast.Expression(
        body=ast.Lambda(
            args=ast.arguments(
                posonlyargs=[],
                args=[ast.arg(arg="_ctx")],
                kwonlyargs=[],
                kw_defaults=[],
                defaults=[],
            ),
            body=body,
        )
    )
    ast.fix_missing_locations(lam)
    code = compile(lam, f"<invariant {source!r}>", "eval")
    return eval(code, {"__builtins__": {}, **FUNCTIONS})  # noqa: S307 - AST checked above


def _parse(source: str) -> ast.Expression:
    """Parse with the length bound first: Python's parser and AST builder recurse, and a
    100,000-term expression would exhaust them before any of our checks ran."""
    if not isinstance(source, str):
        raise ExpressionError(f"an expression must be a string, got {type(source).__name__}")
    if len(source) > MAX_SOURCE_CHARS:
        raise ExpressionError(
            f"expression is {len(source)} characters long; at most "
            f"{MAX_SOURCE_CHARS} are allowed: split it into several invariants"
        )
    try:
        return ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"invalid expression {source!r}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes; parser limits
        raise ExpressionError(f"invalid expression {source!r}: {exc}") from None


def _check_structure(tree: ast.Expression, source: str, known: set[str]) -> None:
    """Every node allowed, within the depth and size bounds; calls, names and constants
    checked. Walks with an explicit stack, so depth is measured before anything recurses."""
    count = 0
    stack: list[tuple[ast.AST, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ExpressionError(
                f"expression {_short(source)} has more than {MAX_NODES} parts "
                "(names, constants, operators); split it into several invariants"
            )
        if depth > MAX_DEPTH:
            raise ExpressionError(
                f"expression {_short(source)} is nested deeper than {MAX_DEPTH} "
                "levels; write it flatter or split it"
            )
        if not isinstance(node, _ALLOWED_NODES):
            raise ExpressionError(
                f"expression {source!r} uses {type(node).__name__}, which is not allowed; "
                "use field names, constants, operators and " + ", ".join(sorted(FUNCTIONS))
            )
        if isinstance(node, ast.Call):
            if (
                not isinstance(node.func, ast.Name)
                or node.func.id not in FUNCTIONS
                or node.keywords
            ):
                raise ExpressionError(
                    f"expression {source!r} calls something other than "
                    + ", ".join(sorted(FUNCTIONS))
                )
            if len(node.args) != 1:
                raise ExpressionError(
                    f"expression {source!r}: {node.func.id} takes exactly one "
                    f"argument, got {len(node.args)}"
                )
        elif isinstance(node, ast.Name) and node.id not in known and node.id not in FUNCTIONS:
            raise ExpressionError(
                f"expression {source!r} names {node.id!r}, which is not a context field; "
                f"known fields: {_known(known)}"
            )
        elif isinstance(node, ast.Constant):
            _check_constant(node.value, source)
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.LShift)
            and isinstance(node.right, ast.Constant)
            and type(node.right.value) is int
            and not 0 <= node.right.value < MAX_SHIFT
        ):
            raise ExpressionError(
                f"expression {source!r} shifts by {show_int(node.right.value)}; "
                f"a constant shift must be in [0, {MAX_SHIFT})"
            )
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _check_constant(value: Any, source: str) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if type(value) is int:
        if not -MAX_INT < value < MAX_INT:
            raise ExpressionError(
                f"expression {_short(source)}: constant {show_int(value)} is out "
                "of range; integers in an invariant must be above -2**63 and "
                "below 2**63"
            )
        return
    if type(value) is float:
        if not math.isfinite(value):  # 1e400 parses as inf
            raise ExpressionError(f"expression {source!r}: constant {value!r} is not finite")
        return
    raise ExpressionError(
        f"expression {source!r}: constant {value!r} ({type(value).__name__}) is "
        "not allowed; only ints, floats, strs, True/False and None may appear"
    )


def _known(names: set[str], shown: int = 20) -> str:
    """The known names, sorted; a long list shows its first names and counts the rest."""
    ordered = sorted(names)
    rest = f", ... ({len(ordered) - shown} more)" if len(ordered) > shown else ""
    return ", ".join(ordered[:shown]) + rest


def _short(source: str) -> str:
    """An expression for a message: long ones are cut (they are the ones refused for size)."""
    return (
        repr(source) if len(source) <= 80 else repr(source[:60]) + f"... ({len(source)} characters)"
    )


# -- static types -------------------------------------------------------------------------
# Types are the context types (int, bool, float, str, bitmap, object) plus "none" (the
# constant None) and "any" (a value whose type depends on the run, e.g. ``a or b`` of
# two types). "object" is opaque: it may be compared for identity or equality, measured
# with len() and tested for truth, nothing else.

_INTEGRAL = frozenset({"int", "bool", "bitmap"})
_NUMBER = _INTEGRAL | {"float"}
_WHAT = {
    "int": "an int",
    "bool": "a bool",
    "float": "a float",
    "str": "a str",
    "bitmap": "a bitmap",
    "object": "an object",
    "none": "None",
    "any": "any value",
}
_SYMBOL = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
}
#: What each function takes, and its result given the argument's type.
_CALLS: dict[str, tuple[frozenset[str], str]] = {
    "popcount": (_INTEGRAL, "an int, bitmap or bool"),
    "len": (frozenset({"str", "object"}), "a str or object"),
    "abs": (frozenset({"int", "float"}), "an int or float"),
}


def _family(t: str) -> str:
    return "number" if t in _NUMBER else t


class _TypeChecker:
    """Computes each node's static type, raising at the first operator or call whose
    operands cannot be right. Recursive; the depth was bounded by _check_structure."""

    def __init__(self, source: str, types: Mapping[str, str]):
        self.source = source
        self.types = types

    def fail(self, node: ast.AST, why: str) -> None:
        raise ExpressionError(f"expression {self.source!r}: {ast.unparse(node)} {why}")

    def describe(self, node: ast.AST, t: str) -> str:
        """'end_reason is a str' for a field, '(a + b) is an int' for anything else."""
        text = ast.unparse(node)
        if not isinstance(node, (ast.Name, ast.Constant, ast.Call)):
            text = f"({text})"
        return f"{text} is {_WHAT[t]}"

    def type_of(self, node: ast.AST) -> str:
        if isinstance(node, ast.Constant):
            v = node.value
            return (
                "none"
                if v is None
                else "bool"
                if isinstance(v, bool)
                else {int: "int", float: "float", str: "str"}[type(v)]
            )
        if isinstance(node, ast.Name):
            return self.types.get(node.id, "any")
        if isinstance(node, ast.Call):
            func = node.func
            assert isinstance(func, ast.Name)  # parsing admits only calls of FUNCTIONS by name
            arg = node.args[0]
            t = self.type_of(arg)
            takes, what = _CALLS[func.id]
            if t != "any" and t not in takes:
                self.fail(node, f"takes {what}, but {self.describe(arg, t)}")
            if func.id == "abs":
                return t
            return "int"
        if isinstance(node, ast.UnaryOp):
            t = self.type_of(node.operand)
            if isinstance(node.op, ast.Not):
                return "bool"
            if isinstance(node.op, ast.Invert):
                if t != "any" and t not in _INTEGRAL:
                    self.fail(
                        node, f"takes an int, bitmap or bool, but {self.describe(node.operand, t)}"
                    )
                return "int"
            if t != "any" and t not in _NUMBER:
                self.fail(node, f"takes a number, but {self.describe(node.operand, t)}")
            return "float" if t == "float" else "any" if t == "any" else "int"
        if isinstance(node, ast.BinOp):
            left, right = self.type_of(node.left), self.type_of(node.right)
            return self.binop(node, left, right)
        if isinstance(node, ast.BoolOp):
            kinds = {self.type_of(v) for v in node.values}
            return kinds.pop() if len(kinds) == 1 else "any"
        if isinstance(node, ast.IfExp):
            self.type_of(node.test)
            a, b = self.type_of(node.body), self.type_of(node.orelse)
            return a if a == b else self.arithmetic(a, b) if {a, b} <= _NUMBER else "any"
        if isinstance(node, ast.Compare):
            left_node, left = node.left, self.type_of(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = self.type_of(right_node)
                self.compare(
                    ast.Compare(left=left_node, ops=[op], comparators=[right_node]),
                    op,
                    left_node,
                    left,
                    right_node,
                    right,
                )
                left_node, left = right_node, right
            return "bool"
        raise AssertionError(f"unchecked node {type(node).__name__}")  # _ALLOWED_NODES drifted

    @staticmethod
    def arithmetic(a: str, b: str) -> str:
        return "any" if "any" in (a, b) else "float" if "float" in (a, b) else "int"

    def binop(self, node: ast.BinOp, left: str, right: str) -> str:
        symbol = _SYMBOL[type(node.op)]
        if "any" in (left, right):
            return "any"
        if isinstance(node.op, ast.Add) and left == right == "str":
            return "str"
        if isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            if left in _NUMBER and right in _NUMBER:
                return self.arithmetic(left, right)
            takes = "two numbers (or, for +, two strs)"
        else:
            if left in _INTEGRAL and right in _INTEGRAL:
                return "int"
            takes = "an int, bitmap or bool on each side"
        self.fail(node, f"combines {left} and {right}; {symbol} takes {takes}")
        return "any"

    def compare(
        self,
        pair: ast.Compare,
        op: ast.cmpop,
        left_node: ast.AST,
        left: str,
        right_node: ast.AST,
        right: str,
    ) -> None:
        if isinstance(op, (ast.Is, ast.IsNot)):
            if not any(
                isinstance(n, ast.Constant) and n.value is None for n in (left_node, right_node)
            ):
                self.fail(
                    pair, "uses 'is'; use 'is' only with None and compare values with == or !="
                )
            return
        if "any" in (left, right):
            return
        if isinstance(op, (ast.Eq, ast.NotEq)):
            families = {_family(left), _family(right)}
            if "object" not in families and len(families) == 2:
                self.fail(
                    pair,
                    f"compares {left} and {right}, which are never equal"
                    + ("; test for None with 'is None'" if "none" in families else ""),
                )
            return
        if (left in _NUMBER and right in _NUMBER) or left == right == "str":
            return
        self.fail(
            pair, f"compares {left} and {right}; {_SYMBOL[type(op)]} takes two numbers or two strs"
        )
