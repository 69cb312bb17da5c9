"""A small, safe expression language for spec invariants.

Invariants are Python-syntax boolean expressions over context field names, e.g.
``"posted & ~scheduled == 0"``. Only arithmetic, bitwise, comparison and boolean
operators, constants, field names and the functions in ``FUNCTIONS`` are allowed;
anything else is refused at load time with the offending construct named.
"""

from __future__ import annotations

from ..errors import MoriioFsmError

import ast
from typing import Any, Callable, Iterable


def _popcount(value: int) -> int:
    return int(value).bit_count()


FUNCTIONS: dict[str, Callable[..., Any]] = {"popcount": _popcount, "len": len, "abs": abs}

_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.Invert,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.BitAnd, ast.BitOr, ast.BitXor, ast.LShift,
    ast.RShift, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is,
    ast.IsNot, ast.Name, ast.Load, ast.Constant, ast.Call, ast.IfExp,
)


class ExpressionError(MoriioFsmError, ValueError):
    """The expression is not valid Python or uses a construct or name not allowed."""


def compile_predicate(source: str, names: Iterable[str]) -> Callable[[Any], bool]:
    """Compile ``source`` into ``f(obj) -> bool`` that reads names as attributes of obj.

    Raises ``ExpressionError`` naming the first disallowed construct or unknown name.
    """
    known = set(names)
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"invalid expression {source!r}: {exc.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise ExpressionError(
                f"expression {source!r} uses {type(node).__name__}, which is not allowed; "
                "use field names, constants, operators and " + ", ".join(sorted(FUNCTIONS)))
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
                raise ExpressionError(
                    f"expression {source!r} calls something other than "
                    + ", ".join(sorted(FUNCTIONS)))
        elif isinstance(node, ast.Name) and node.id not in known and node.id not in FUNCTIONS:
            raise ExpressionError(
                f"expression {source!r} names {node.id!r}, which is not a context field; "
                f"known fields: {', '.join(sorted(known))}")
    # Rewrite bare field names into attribute reads of the single argument so the
    # compiled function works on any object carrying the context as attributes.
    class _Bind(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in FUNCTIONS:
                return node
            return ast.copy_location(
                ast.Attribute(value=ast.Name(id="_ctx", ctx=ast.Load()), attr=node.id,
                              ctx=ast.Load()), node)

    body = _Bind().visit(tree).body
    lam = ast.Expression(body=ast.Lambda(
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg="_ctx")], kwonlyargs=[],
                           kw_defaults=[], defaults=[]),
        body=body))
    ast.fix_missing_locations(lam)
    code = compile(lam, f"<invariant {source!r}>", "eval")
    return eval(code, {"__builtins__": {}, **FUNCTIONS})  # noqa: S307 - AST checked above
