"""Binding a spec's named guards and effects to Python functions.

A machine module creates one ``Bindings`` and decorates its functions with
``@bindings.guard`` and ``@bindings.effect``. ``check`` then proves the bindings and
the spec agree name for name, so a typo on either side fails at load time.

Signatures: ``guard(transfer, event) -> bool`` reads the context and must not change
it; ``effect(transfer, event, out)`` may update the context and appends ``Effect``
values to ``out``. Neither performs I/O: effects are returned, not executed.
"""

from __future__ import annotations

from typing import Any, Callable

from ..lang.errors import Problem, SpecError
from ..lang.model import Spec

Guard = Callable[[Any, Any], bool]
EffectFn = Callable[[Any, Any, list], None]


class Bindings:
    """The Python half of one spec: its guard and effect functions by name."""

    def __init__(self, spec_name: str):
        self.spec_name = spec_name
        self.guards: dict[str, Guard] = {}
        self.effects: dict[str, EffectFn] = {}

    def guard(self, fn: Guard) -> Guard:
        self._add(self.guards, fn, "guard")
        return fn

    def effect(self, fn: EffectFn) -> EffectFn:
        self._add(self.effects, fn, "effect")
        return fn

    def _add(self, table: dict, fn: Callable, kind: str) -> None:
        if fn.__name__ in table:
            raise ValueError(f"{kind} {fn.__name__!r} is bound twice for spec {self.spec_name!r}")
        table[fn.__name__] = fn

    def check(self, spec: Spec) -> None:
        """Raise ``SpecError`` unless every declared name is bound and every binding declared."""
        problems: list[Problem] = []
        for kind, declared, bound in (("guard", spec.guards, self.guards),
                                      ("effect", spec.effects, self.effects)):
            for name, (_, line) in declared.items():
                if name not in bound:
                    problems.append(Problem(spec.path, line,
                                            f"{kind} {name!r} is declared in the spec but has no "
                                            f"Python binding in the {self.spec_name!r} machine module"))
            for name in bound:
                if name not in declared:
                    problems.append(Problem(spec.path, spec.line,
                                            f"{kind} {name!r} is bound in Python but not declared "
                                            f"under '{kind}s' in the spec"))
        if spec.name != self.spec_name:
            problems.append(Problem(spec.path, spec.line,
                                    f"spec is named {spec.name!r} but the bindings are for "
                                    f"{self.spec_name!r}"))
        if problems:
            raise SpecError(problems)
