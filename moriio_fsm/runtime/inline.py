"""Inline the bodies of simple guards and actions into generated steps.

A step calls a guard or an action once per layer per transfer; in CPython a call costs
as much as the body of most bindings. ``inline_guard`` and ``inline_action`` return the
source lines of a binding rewritten to run in place: parameters renamed to the step's
``tx``, ``ev`` and ``out``, locals given a suffix of the binding's name, module globals
bound under unique names, config keys read off the record (``tx.max_layers``) replaced
by their values, event fields the step reads once up front (``ev.layer``: events are
immutable) replaced by those locals, and ``emits.<kind>`` replaced by the effect class.

Rules: only plain functions are inlined (no closure, no defaults, no nested scopes such
as comprehensions or lambdas, no ``global``/``nonlocal``, no ``yield``/``await``, no
``try``/``with``/``import``/``match``, no assignment to a parameter, no frame
introspection); a guard's body must end in its only ``return``; an action's body has no
``return``. Renamed locals start with ``_``, which no name of a step does; functions,
classes and modules are bound once, other module globals read live. Anything else
returns None and the step calls the binding instead, so inlining never changes what a
binding means, only what it costs.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

_SCOPES = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
    ast.Global,
    ast.Nonlocal,
    ast.Yield,
    ast.YieldFrom,
    ast.Await,
)


class Inlined:
    """A binding rewritten for a step: ``lines`` to run first, then (guards) ``test``,
    the expression to branch on."""

    def __init__(self, lines: list[str], test: str | None):
        self.lines = lines
        self.test = test


def _function_ast(fn: Callable) -> ast.FunctionDef | None:
    if not inspect.isfunction(fn) or fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__:
        return None
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    node = tree.body[0]
    if node.name != fn.__name__:
        return None
    args = node.args
    if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg:
        return None
    body = node.body
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        body = body[1:]  # drop the docstring
    node.body = body
    for sub in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(sub, _SCOPES):
            return None
    return node


#: Statements and expressions whose meaning a rewrite could change: names they bind that
#: are not plain assignments, or introspection of the frame they run in.
_REFUSED = (
    ast.Import,
    ast.ImportFrom,
    ast.Match,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    *(getattr(ast, name) for name in ("TryStar",) if hasattr(ast, name)),
)
_INTROSPECTION = {"locals", "vars", "eval", "exec", "globals", "dir", "super", "__import__"}


def _foldable(value: Any) -> bool:
    """A config value that can stand in the source as a literal without changing how the
    expression around it parses (no sign, no exotic type)."""
    return type(value) in (int, float) and value >= 0 and value == value and value != float("inf")


class _Rewriter(ast.NodeTransformer):
    def __init__(
        self,
        fn: Callable,
        params: dict[str, str],
        locals_: set[str],
        suffix: str,
        bind: Callable[[Any, str], str],
        config: dict[str, Any],
        effect_classes: dict,
        hoisted: frozenset,
    ):
        self.fn = fn
        self.params = params
        self.locals = locals_
        self.suffix = suffix
        self.bind = bind
        self.config = config
        self.effect_classes = effect_classes
        self.hoisted = hoisted
        self.module = sys.modules.get(getattr(fn, "__module__", None) or "")
        self.failed = False

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.params:
            if not isinstance(node.ctx, ast.Load):
                self.failed = True  # rebinding tx/ev/out would rebind the step's
            return ast.copy_location(ast.Name(self.params[node.id], node.ctx), node)
        if node.id in self.locals:
            # Renamed locals start with "_": no name a step uses for itself does.
            return ast.copy_location(ast.Name(f"_{node.id}_{self.suffix}", node.ctx), node)
        if not isinstance(node.ctx, ast.Load) or node.id in _INTROSPECTION:
            self.failed = True
            return node
        if node.id in self.fn.__globals__:
            value = self.fn.__globals__[node.id]
        elif hasattr(builtins, node.id):
            return node  # builtins resolve the same here
        else:
            self.failed = True  # an unresolvable name: do not inline
            return node
        if callable(value) or isinstance(value, types.ModuleType) or self.module is None:
            # Functions, classes and modules are bound once, under a name of their own.
            return ast.copy_location(ast.Name(self.bind(value, f"_G_{node.id}"), ast.Load()), node)
        # Other globals are read live off their module, as the binding itself would.
        module = ast.Name(self.bind(self.module, f"_M_{self.module.__name__}"), ast.Load())
        return ast.copy_location(ast.Attribute(module, node.id, ast.Load()), node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        # emits.<kind>(transfer_id, field=value, ...) naming exactly the declared fields,
        # in declared order, becomes a positional call: the same effect, built faster,
        # with the arguments evaluated in the same order.
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "emits"
            and func.value.id not in self.params
            and func.value.id not in self.locals
            and func.attr in self.effect_classes
            and len(node.args) == 1
            and all(k.arg for k in node.keywords)
        ):
            fields = self.effect_classes[func.attr].__struct_fields__[1:]
            if tuple(k.arg for k in node.keywords) == tuple(fields):
                node = ast.copy_location(
                    ast.Call(
                        func=func,
                        args=[node.args[0]] + [k.value for k in node.keywords],
                        keywords=[],
                    ),
                    node,
                )
        self.generic_visit(node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        value = node.value
        if isinstance(value, ast.Name) and isinstance(node.ctx, ast.Load):
            if (
                self.params.get(value.id) == "tx"
                and node.attr in self.config
                and _foldable(self.config[node.attr])
            ):
                return ast.copy_location(ast.Constant(self.config[node.attr]), node)
            if self.params.get(value.id) == "ev" and node.attr in self.hoisted:
                return ast.copy_location(ast.Name(f"ev_{node.attr}", ast.Load()), node)
            if (
                value.id not in self.params
                and value.id not in self.locals
                and value.id == "emits"
                and node.attr in self.effect_classes
            ):
                cls = self.effect_classes[node.attr]
                return ast.copy_location(ast.Name(self.bind(cls, cls.__name__), ast.Load()), node)
        self.generic_visit(node)
        return node


def _rewrite(fn: Callable, names: tuple[str, ...], bind, config, effect_classes, hoisted):
    node = _function_ast(fn)
    if node is None or len(node.args.args) != len(names):
        return None
    if any(isinstance(sub, _REFUSED) for stmt in node.body for sub in ast.walk(stmt)):
        return None
    params = {arg.arg: name for arg, name in zip(node.args.args, names)}
    locals_ = {
        sub.id
        for stmt in node.body
        for sub in ast.walk(stmt)
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del))
    }
    locals_ -= set(params)
    rewriter = _Rewriter(fn, params, locals_, fn.__name__, bind, config, effect_classes, hoisted)
    body = [rewriter.visit(stmt) for stmt in node.body]
    if rewriter.failed:
        return None
    return _propagate_copies(body)


def _propagate_copies(body: list) -> list:
    """Drop ``_local = ev_<field>`` when the local is never assigned again, reading the
    step's ``ev_<field>`` wherever the local was read: both hold the same immutable
    event field, and the step saves a store and a load per use."""
    stores: dict[str, int] = {}
    for stmt in body:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Load):
                stores[sub.id] = stores.get(sub.id, 0) + 1
    copies = {}
    for stmt in body:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Name)
            and stmt.value.id.startswith("ev_")
            and stores.get(stmt.targets[0].id) == 1
        ):
            copies[stmt.targets[0].id] = stmt.value.id

    class Substitute(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in copies and isinstance(node.ctx, ast.Load):
                return ast.copy_location(ast.Name(copies[node.id], ast.Load()), node)
            return node

    kept = [
        stmt
        for stmt in body
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in copies
        )
    ]
    return [Substitute().visit(stmt) for stmt in kept]


def inline_guard(
    fn: Callable,
    bind,
    config: dict[str, Any],
    effect_classes: dict,
    hoisted: frozenset = frozenset(),
) -> Inlined | None:
    """``fn(tx, ev) -> bool`` as lines plus a test expression, or None if not inlinable.
    ``hoisted`` names the event fields the step has read into ``ev_<field>`` locals."""
    body = _rewrite(fn, ("tx", "ev"), bind, config, effect_classes, hoisted)
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        return None
    if any(isinstance(sub, ast.Return) for stmt in body[:-1] for sub in ast.walk(stmt)):
        return None
    lines = [line for stmt in body[:-1] for line in ast.unparse(stmt).splitlines()]
    return Inlined(lines, f"({ast.unparse(body[-1].value)})")


def inline_action(
    fn: Callable,
    bind,
    config: dict[str, Any],
    effect_classes: dict,
    hoisted: frozenset = frozenset(),
) -> Inlined | None:
    """``fn(tx, ev, out)`` as lines, or None if not inlinable (``hoisted``: as above)."""
    body = _rewrite(fn, ("tx", "ev", "out"), bind, config, effect_classes, hoisted)
    if body is None:
        return None
    if any(isinstance(sub, ast.Return) for stmt in body for sub in ast.walk(stmt)):
        return None
    lines = [line for stmt in body for line in ast.unparse(stmt).splitlines()]
    return Inlined(lines or ["pass"], None)
