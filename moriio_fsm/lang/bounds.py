"""Bounds between config keys: a key's ``exceeds`` names keys (``machine.key``, of its own
machine or of one it runs with) whose values' sum its value must exceed.

Rules: ``bound_problems`` checks, when a spec is loaded, that each named machine and key
exist and that the defaults keep every bound; ``broken_bounds`` checks the resolved configs
of machines that run together, every bound whose machines are all among them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MoriioFsmError
from .errors import Problem
from .model import ConfigKey, ConfigRef, Spec
from .spec_reader import listing

#: Finds the spec of a machine by name; ``None`` when there is none.
Lookup = Callable[[str], Spec | None]


def _number(value: Any) -> str:
    # Sums of floats are rounded for the message only (0.1 + 0.2 reads 0.3).
    return repr(round(value, 9))


@dataclass(frozen=True)
class BrokenBound:
    """A config value that does not exceed the sum its bound names."""

    machine: str
    key: str
    value: Any
    terms: tuple[tuple[ConfigRef, Any], ...]
    where: str  # path:line of the key that states the bound

    @property
    def needed(self) -> Any:
        return sum(value for _, value in self.terms)

    def rule(self) -> str:
        """``m's k (5.0) must exceed n's a (3.0) + b (4.0) = 7.0``."""
        return f"{self.machine}'s {self.key} ({_number(self.value)}) must exceed {self._sum()}"

    def __str__(self) -> str:
        return f"{self.rule()} (the bound at {self.where})"

    def _sum(self) -> str:
        """``m's a (1.0) + b (2.0) + n's c (3.0) = 6.0``: a machine is named once per run of
        its keys."""
        parts, machine = [], None
        for ref, value in self.terms:
            owner = f"{ref.machine}'s " if ref.machine != machine else ""
            parts.append(f"{owner}{ref.key} ({_number(value)})")
            machine = ref.machine
        total = f" = {_number(self.needed)}" if len(self.terms) > 1 else ""
        return " + ".join(parts) + total


class ConfigBoundError(MoriioFsmError, ValueError):
    """Configs of machines that run together break a bound of their specs."""

    def __init__(self, broken: list[BrokenBound]):
        self.broken = list(broken)
        super().__init__("; ".join(map(str, self.broken)))


def bounds_of(spec: Spec) -> Iterator[ConfigKey]:
    """The config keys of ``spec`` that state a bound."""
    return (key for key in spec.config.values() if key.exceeds)


def broken_bounds(
    specs: Mapping[str, Spec], configs: Mapping[str, Mapping[str, Any]]
) -> list[BrokenBound]:
    """Every bound of ``specs`` (by machine name) that ``configs`` (machine name -> its
    resolved config) break. A bound naming a machine without a config here relates
    machines that do not run together, and is not checked."""
    broken = []
    for name, spec in specs.items():
        for key in bounds_of(spec):
            if name in configs and all(ref.machine in configs for ref in key.exceeds):
                found = _check(spec, name, key, configs)
                if found is not None:
                    broken.append(found)
    return broken


def _check(
    spec: Spec, machine: str, key: ConfigKey, configs: Mapping[str, Mapping[str, Any]]
) -> BrokenBound | None:
    """The bound of ``key`` (of ``spec``, run as ``machine``) if ``configs`` break it."""
    terms = tuple((ref, _value(configs, ref.machine, ref.key)) for ref in key.exceeds)
    value = _value(configs, machine, key.name)
    if value > sum(v for _, v in terms):
        return None
    return BrokenBound(machine, key.name, value, terms, f"{spec.path}:{key.line}")


def _value(configs: Mapping[str, Mapping[str, Any]], machine: str, key: str) -> Any:
    config = configs[machine]
    if key not in config:
        raise ValueError(
            f"the config of machine {machine!r} has no key {key!r}; pass resolved "
            "configs (every key, defaults included)"
        )
    return config[key]


def bound_problems(spec: Spec, lookup: Lookup, known: Sequence[str] = ()) -> list[Problem]:
    """The problems of ``spec``'s bounds: a machine ``lookup`` does not find (``spec``'s
    own name is ``spec``; ``known`` lists the others for the message), a key that machine
    lacks, a key bound by itself, defaults that break the bound."""
    problems: list[Problem] = []
    for key in bounds_of(spec):
        specs = {spec.name: spec}
        wrong = [
            Problem(spec.path, ref.line, message)
            for ref in key.exceeds
            if (message := _reference_problem(spec, key, ref, specs, lookup, known))
        ]
        problems += wrong
        if not wrong:
            defaults = {name: s.default_config() for name, s in specs.items()}
            broken = _check(spec, spec.name, key, defaults)
            if broken is not None:
                problems.append(
                    Problem(spec.path, key.line, f"the defaults break a bound: {broken.rule()}")
                )
    return problems


def _reference_problem(
    spec: Spec,
    key: ConfigKey,
    ref: ConfigRef,
    specs: dict[str, Spec],
    lookup: Lookup,
    known: Sequence[str],
) -> str | None:
    """Why ``ref`` in the bound of ``key`` names nothing (None when it is sound); the spec
    of each machine it names is added to ``specs``."""
    where = f"config key {key.name!r}: exceeds"
    if ref.machine not in specs:
        found = lookup(ref.machine)
        if found is None:
            others = [name for name in known if name != spec.name]
            return (
                f"{where} names unknown machine {ref.machine!r}; known machines: "
                f"{listing([spec.name, *others])}"
            )
        specs[ref.machine] = found
    if ref.key not in specs[ref.machine].config:
        return (
            f"{where} names {str(ref)!r}, but machine {ref.machine!r} has no config key "
            f"{ref.key!r}; its keys: {listing(specs[ref.machine].config)}"
        )
    if (ref.machine, ref.key) == (spec.name, key.name):
        return f"{where} names the key itself; a key cannot exceed a sum that holds it"
    return None
