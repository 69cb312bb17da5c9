"""Load a spec from YAML into ``moriio_fsm.lang.model.Spec`` with precise errors.

The loader keeps the line of every mapping key and list item (``yaml_lines.py``), so
each problem it or the validator reports points at ``file:line``. It collects all
problems of a file and raises one ``SpecError`` listing them, rather than stopping at
the first; each section of a spec has its reader (``sections.py``). A bound on a config
key (``exceeds``) may name another machine's keys: that machine's shipped spec is read to
check them (``bounds.py``).

Rules: every input, however broken or hostile, ends in a spec or a ``SpecError``, in
time and memory bounded by the file's size, which is itself bounded (``MAX_SPEC_BYTES``).
YAML features a spec never needs and that can make a small file huge or deep (anchors
and aliases, deep nesting, giant integers) are refused where they appear.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .bounds import bound_problems
from .errors import Problem, SpecError
from .model import Spec
from .sections import read_spec
from .shipped_files import SHIPPED_SPECS, spec_path
from .spec_reader import SpecReader
from .validate import validate_spec
from .yaml_lines import MAX_INT_DIGITS, MAX_NESTING, read_yaml

__all__ = ["MAX_INT_DIGITS", "MAX_NESTING", "MAX_SPEC_BYTES", "load_spec", "parse_spec"]

#: The largest spec file (in UTF-8 bytes) the loader reads. The shipped spec is ~21 KB; a
#: mebibyte of YAML takes the pure-Python parser several seconds already.
MAX_SPEC_BYTES = 1 << 20


def _too_big(path: str, size: str) -> Problem:
    """The refusal of a spec over ``MAX_SPEC_BYTES`` (line 0: the whole file)."""
    return Problem(
        path,
        0,
        f"spec is {size}; a spec may be at most {MAX_SPEC_BYTES // 2**20} MiB "
        f"({MAX_SPEC_BYTES} bytes) of UTF-8: split it into several specs",
    )


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB ({size} bytes)"


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file.

    Raises ``SpecError`` listing every problem with its ``file:line``; the spec is
    returned only when it passed every check in ``moriio_fsm.lang.validate`` and its
    bounds (``bounds.py``) name known machines and keys and hold for the defaults.
    """
    path = Path(path)
    spec = parse_spec(_read(path), str(path))
    problems = validate_spec(spec) + bound_problems(spec, _shipped_spec, SHIPPED_SPECS)
    if problems:
        raise SpecError(problems)
    return spec


def _read(path: Path) -> str:
    """The text of a spec file; ``SpecError`` when it cannot be read, is over
    ``MAX_SPEC_BYTES`` or is not UTF-8."""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            # Read one byte past the cap, never more: a huge file or an endless one
            # (/dev/zero) costs no more memory than a spec that is just too big.
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError([Problem(str(path), 0, f"cannot read spec: {exc.strerror}")]) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError([_too_big(str(path), _mib(max(size, len(data))))])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(
            [
                Problem(
                    str(path),
                    line,
                    f"spec is not UTF-8: byte 0x{data[exc.start]:02x} "
                    f"at column {column} cannot be decoded "
                    f"({exc.reason}); save the spec as UTF-8",
                )
            ]
        ) from None


def _shipped_spec(name: str) -> Spec | None:
    """The shipped spec of machine ``name`` as parsed, for the bounds that name it; None
    when none ships. Parsed, not loaded: its own bounds are not followed, so two specs
    whose bounds name each other do not load each other forever."""
    if name not in SHIPPED_SPECS:
        return None
    path = spec_path(name)
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        mtime_ns = -1  # _read reports the unreadable file with its path
    return _parsed(str(path), mtime_ns)


@functools.lru_cache(maxsize=8)
def _parsed(path: str, mtime_ns: int) -> Spec:
    # Keyed on the modification time, so an edited spec is read again.
    return parse_spec(_read(Path(path)), path)


def parse_spec(text: str, path: str = "<string>") -> Spec:
    """Parse YAML text into a ``Spec`` without the structural checks of ``validate``.

    Raises ``SpecError`` for YAML syntax errors, duplicate keys, missing sections,
    wrong types and references to undeclared names.
    """
    # Characters first: there are no more of them than bytes, so only a text that may
    # be under the cap is encoded to measure it (costing at most 4 MiB).
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError([_too_big(path, f"{len(text)} characters long")])
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise SpecError([_too_big(path, _mib(size))])
    raw, duplicate_keys = read_yaml(text, path)
    reader = SpecReader(path)
    for line, key in duplicate_keys:
        reader.problem(line, f"duplicate key {key!r}: each name may appear once")
    if not isinstance(raw, dict):
        raise SpecError(
            [Problem(path, 1, "a spec must be a YAML mapping at the top level")] + reader.problems
        )
    return read_spec(reader, raw, path)
