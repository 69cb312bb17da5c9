"""The reading primitives of the spec loader: each turns one raw YAML value into a model
value or records a problem at its line.

Rules: a primitive never raises for bad input; it records a ``Problem`` (file:line, a
message naming the thing and what was expected) and returns a neutral value, so the
loader can go on and report every problem of a file at once. Values quoted back are
cut short (``yaml_lines.show``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast

from .errors import Problem
from .expr import FUNCTIONS
from .model import RESERVED_NAMES
from .yaml_lines import LineDict, kind_of, line_of, show

#: Integers a spec gives (config defaults, context initials, payload defaults) stay in
#: the signed 64-bit range, the range the runtime, codecs and wire formats assume.
MAX_INT = 2**63
#: Names starting with this are the runtime's (e.g. the pytransitions trigger of eventless
#: rows is ``__eventless__``; dunders are Python's); no spec name may take them.
RESERVED_PREFIX = "__"


def listing(names: Any, shown: int = 20) -> str:
    """``a, b, c`` for a message; a long list shows its first names and counts the rest,
    so that a thousand problems in a spec of thousands of names stay small."""
    names = list(names)
    if len(names) <= shown:
        return ", ".join(map(str, names))
    return ", ".join(map(str, names[:shown])) + f", ... ({len(names) - shown} more)"


def out_of_range(value: Any) -> bool:
    """True for an int outside the signed 64-bit range or a float that is not finite."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -MAX_INT < value < MAX_INT
    return isinstance(value, float) and not math.isfinite(value)


def reserved_message(what: str, key: str) -> str:
    return (
        f"{what} name {key!r} is reserved: names starting with '__' belong to the "
        "runtime (it names eventless rows '__eventless__') and to Python"
    )


class SpecReader:
    """Turns the raw YAML tree into model objects, collecting problems on the way."""

    def __init__(self, path: str):
        self.path = path
        self.problems: list[Problem] = []

    def problem(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.path, line, message))

    def mapping(self, parent: Any, key: str, line: int, required: bool = True) -> LineDict:
        value = parent.get(key) if isinstance(parent, dict) else None
        if value is None:
            if required:
                self.problem(line, f"missing section {key!r} (expected a mapping)")
            return LineDict()
        if not isinstance(value, dict):
            self.problem(
                line_of(parent, key, line), f"{key!r} must be a mapping, got {kind_of(value)}"
            )
            return LineDict()
        return cast(LineDict, value)  # the YAML reader builds every mapping as a LineDict

    def names(self, raw: Any, line: int, what: str) -> tuple[str, ...]:
        """A state/event list may be one name or a list of names."""
        if isinstance(raw, str):
            return (raw,)
        if isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            return tuple(raw)
        self.problem(line, f"{what} must be a name or a non-empty list of names, got {show(raw)}")
        return ()

    def name(self, raw: Any, line: int, what: str) -> str | None:
        """An optional single name (event, guard, dest); anything else is a problem."""
        if raw is None or isinstance(raw, str):
            return raw
        self.problem(line, f"{what} must be a name, got {show(raw)}")
        return None

    def flag(self, entry: dict, key: str, line: int, what: str) -> bool:
        """An optional true/false; a string such as 'no' must not read as true."""
        value = entry.get(key, False)
        if not isinstance(value, bool):
            self.problem(
                line_of(entry, key, line),
                f"{what}: {key!r} must be true or false, got {show(value)}",
            )
            return False
        return value

    def text(self, raw: Any, line: int, what: str) -> str:
        if raw is None:
            return ""
        if not isinstance(raw, str):
            self.problem(line, f"{what} must be text, got {kind_of(raw)}")
            return ""
        return raw.strip()

    def valid_name(self, key: Any, line: int, what: str, attribute: bool = False) -> bool:
        """Names are identifiers; context fields and config keys become record attributes,
        so they also may not shadow the record's own attributes or expression functions."""
        if not isinstance(key, str) or not key.isidentifier():
            self.problem(
                line,
                f"{what} name {show(key)} must be an identifier (letters, digits, underscores)",
            )
            return False
        if key.startswith(RESERVED_PREFIX):
            self.problem(line, reserved_message(what, key))
            return False
        if attribute and (key in RESERVED_NAMES or key in FUNCTIONS or key.startswith("_")):
            self.problem(
                line,
                f"{what} name {key!r} is reserved; avoid "
                f"{', '.join(sorted(RESERVED_NAMES | set(FUNCTIONS)))} and leading underscores",
            )
            return False
        return True

    def entries(
        self, raw: dict, section: str, what: str, *, required: bool = False, attribute: bool = False
    ) -> Iterator[tuple[str, Any, int]]:
        """``(name, entry, line)`` of each entry of the mapping section ``section`` whose
        name is valid (the others are reported; see ``valid_name``)."""
        raw_section = self.mapping(raw, section, 1, required=required)
        for key, entry in raw_section.items():
            line = line_of(raw_section, key, 1)
            if self.valid_name(key, line, what, attribute):
                yield key, entry, line

    def unknown_keys(self, entry: dict, allowed, line: int, what: str, expected: str) -> None:
        """Report every key of ``entry`` not in ``allowed`` (``expected`` lists them)."""
        for extra in entry:
            if extra not in allowed:
                self.problem(
                    line_of(entry, extra, line),
                    f"{what}: unknown key {extra!r}; expected {expected}",
                )

    def known(self, name: str, declared: dict, line: int, what: str, where: str) -> None:
        """Report ``name`` unless ``declared`` has it (``what``: state or event)."""
        if name not in declared:
            self.problem(
                line, f"unknown {what} {name!r} in {where}; known {what}s: {listing(declared)}"
            )
