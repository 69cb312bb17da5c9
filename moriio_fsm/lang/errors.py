"""Errors raised while loading, validating or binding a spec.

Every problem carries the file and line it comes from, so a message reads like a
compiler diagnostic: ``specs/x.yaml:12: unknown state 'sealedd' ...``. Line 0 means the
file as a whole (it cannot be read, or is too big to read).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MoriioFsmError


@dataclass(frozen=True)
class Problem:
    """One defect found in a spec, located at ``path:line``."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


class SpecError(MoriioFsmError, ValueError):
    """A spec is malformed or unsafe; ``problems`` lists every defect found."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
