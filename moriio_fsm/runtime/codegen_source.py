"""The text of a generated module: its lines with the binding and row each came from, the
objects it refers to under unique names, compiled once and registered with ``linecache``.

Rules: every object gets one name, made an identifier by ``codegen_text.ident`` and never
given to another; a line's origin is kept so that an error can name what raised there.
"""

from __future__ import annotations

import hashlib
import linecache
import types
from typing import Any

from .codegen_text import ident, one_line
from .machine import Row

#: What a generated line came from: ("guard" or "action", the binding's name, its row).
Origin = tuple[str, str, Row]

#: How every generated module's file name starts (``codegen.is_generated`` tests it).
FILENAME_PREFIX = "<moriio-fsm steps "


class ModuleSource:
    """The lines of one generated module as they are written, then its compiled code
    (``source``, ``filename`` and ``code`` exist once ``_compile`` ran)."""

    source: str
    filename: str
    code: types.CodeType

    def __init__(self, namespace: dict[str, Any], header: str):
        self._ns = namespace  # what the module's names refer to when it runs
        self._names: dict[int, str] = {}  # id of a bound object -> its name in the module
        self._line_info: dict[int, Origin] = {}
        self._lines: list[str] = [header]
        self._taken: set[str] = set()  # names of generated functions

    def _bind(self, obj: Any, name: str) -> str:
        """The module-level name ``obj`` goes by in the generated source (``name``, made
        unique if another object already took it)."""
        key = id(obj)
        if key not in self._names:
            unique, n = ident(name), 1
            while unique in self._ns:
                n += 1
                unique = f"{ident(name)}_{n}"
            self._names[key] = unique
            self._ns[unique] = obj
        return self._names[key]

    def _line(self, text: str, info: Origin | None = None) -> None:
        self._lines.append(text)
        if info is not None:
            self._line_info[len(self._lines)] = info

    def _unique(self, name: str) -> str:
        """``name``, or ``name_2``... if another generated function already has it."""
        unique, n = name, 1
        while unique in self._taken:
            n += 1
            unique = f"{name}_{n}"
        self._taken.add(unique)
        return unique

    def _compile(self, module_name: str) -> None:
        """Compile the lines written so far under a file name that ``linecache`` knows,
        so that tracebacks and debuggers show the generated lines."""
        source = "\n".join(self._lines) + "\n"
        digest = hashlib.sha1(source.encode()).hexdigest()[:12]
        self.filename = f"{FILENAME_PREFIX}{one_line(module_name)} {digest}>"
        linecache.cache[self.filename] = (len(source), None, source.splitlines(True), self.filename)
        self.source = source
        self.code = compile(source, self.filename, "exec")

    def _origin(self, exc: BaseException) -> Origin | None:
        """The origin of the innermost generated line with one that ``exc`` passed through."""
        origin = None
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self.filename:
                origin = self._line_info.get(tb.tb_lineno, origin)
            tb = tb.tb_next
        return origin
