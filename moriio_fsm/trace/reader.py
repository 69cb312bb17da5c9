"""Reading trace files: records streamed line by line, every defect named by file and line.

Rules: a file is read in bounded pieces (no line over ``MAX_LINE_BYTES`` is ever held),
so a huge or hostile file costs time, not memory. The first line must be a header of a
version this reader knows. Anything else that is wrong (bad JSON, bytes that are not
UTF-8, a field of the wrong type, an out-of-range number, a record cut off at the end of
the file, a record nested deeper than ``MAX_NESTING``) raises
``TraceError("file:line: what was expected")``; nothing else escapes, and every record
returned is shallow enough for any tool to walk.
Numbers are range-checked by the decoder itself: JSON has no NaN or infinity, and a
literal too large for a float is refused, so every number read is finite.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..errors import MoriioFsmError
from .format import (
    DECODER,
    FORMAT,
    MAX_LINE_BYTES,
    MAX_NESTING,
    VERSION,
    Gap,
    Header,
    Record,
    Step,
    TableInfo,
    decode_line,
)


class TraceError(MoriioFsmError, ValueError):
    """A trace file cannot be read as a trace: ``path``, ``line`` and what was wrong."""

    def __init__(self, path: str | Path, line: int, message: str):
        self.path, self.line, self.message = str(path), line, message
        super().__init__(f"{path}:{line}: {message}")


def printable(value: object) -> str:
    """``value`` as text for one line of a terminal: every character that is not printable
    (line breaks, terminal escape sequences) written as its escape. Text read from a
    trace goes through this before it is shown."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _abbreviate(raw: bytes, limit: int = 80) -> str:
    text = raw[:limit].decode("utf-8", "replace").rstrip("\n")
    return printable(text) + ("..." if len(raw) > limit else "")


_STEP_PREFIX = b'{"type":"step"'
_TOO_DEEP = (
    f"the record is nested more than {MAX_NESTING} levels deep (objects and arrays "
    "within each other); a trace record nests a few levels"
)


def _nesting(record: Record) -> int:
    """How deep ``record`` nests, itself the first level (without recursion, so a record
    of any depth is measured in bounded stack)."""
    deepest = 1
    stack = [(getattr(record, name), 2) for name in record.__struct_fields__]
    while stack:
        value, depth = stack.pop()
        children: Iterable
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, (dict, list, tuple))
        )
    return deepest


def iter_records(
    path: str | Path,
    *,
    containing: Iterable[str] | None = None,
    decoder: msgspec.json.Decoder = DECODER,
) -> Iterator[tuple[int, Record]]:
    """``(line number, record)`` for every line of the trace file ``path``, header first.
    ``containing``: skip, without decoding, step lines that hold none of these strings
    (a cheap filter for one transfer's records; every other line is read as usual).
    ``decoder``: ``format.REPLAY_DECODER`` reads steps as ``ReplayStep``."""
    needles = None if containing is None else [msgspec.json.encode(n)[1:-1] for n in containing]
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise TraceError(path, 0, f"cannot read the trace file: {exc.strerror or exc}") from None
    with handle:
        readline = handle.readline
        decode = decoder.decode
        number = 0
        while True:
            try:
                raw = readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise TraceError(path, number + 1, f"cannot read: {exc.strerror or exc}") from None
            if not raw:
                if number == 0:
                    raise TraceError(path, 0, f"the file is empty; expected a {FORMAT} header line")
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES and raw[-1] != 10:
                raise TraceError(
                    path,
                    number,
                    f"the line is longer than {MAX_LINE_BYTES} bytes; "
                    "a trace line holds one record and is far shorter",
                )
            if (
                needles is not None
                and number > 1
                and raw.startswith(_STEP_PREFIX)
                and raw[-1] == 10
                and not any(n in raw for n in needles)
            ):
                continue
            try:
                try:
                    record = decode(raw)
                except (msgspec.ValidationError, msgspec.DecodeError):
                    if raw.isspace():
                        continue  # a blank line
                    record = _decode(path, number, raw)  # raises, naming what is wrong
            except RecursionError:  # the decoder's own depth limit
                raise TraceError(path, number, _TOO_DEEP) from None
            # Every level of nesting opens a bracket, so a line with few brackets is
            # shallow; only one with many is measured (a cheap test on every line).
            if raw.count(b"{") + raw.count(b"[") > MAX_NESTING and _nesting(record) > MAX_NESTING:
                raise TraceError(path, number, _TOO_DEEP)
            if number == 1:
                _check_header(path, record, raw)
            elif record.__class__ is Header:
                raise TraceError(
                    path,
                    number,
                    "a second header line; a trace file has one, "
                    "on its first line (were two files concatenated?)",
                )
            yield number, record


def _decode(path, number: int, raw: bytes) -> Record:
    try:
        return decode_line(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        if number == 1:
            raise TraceError(
                path,
                1,
                f"not a {FORMAT} file: the first line must be its header "
                f'({{"type": "header", "format": "{FORMAT}", ...}}), '
                f"got {_abbreviate(raw)}",
            ) from None
        return _decode_error(path, number, raw)


def _decode_error(path, number: int, raw: bytes) -> Record:
    try:
        return decode_line(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(
            path, number, f"not a valid trace record ({printable(exc)}): {_abbreviate(raw)}"
        ) from None
    except msgspec.DecodeError as exc:
        if not raw.endswith(b"\n"):
            raise TraceError(
                path,
                number,
                "the last record is cut off (the file ends in the "
                "middle of a line: the writer stopped mid-record)",
            ) from None
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise TraceError(
                path,
                number,
                f"the line is not UTF-8 (byte {bad.start}); a trace is UTF-8 JSON Lines",
            ) from None
        raise TraceError(path, number, f"not JSON ({printable(exc)}): {_abbreviate(raw)}") from None


def _check_header(path, record: Record, raw: bytes) -> None:
    if not isinstance(record, Header) or record.format != FORMAT:
        raise TraceError(
            path,
            1,
            f"not a {FORMAT} file: the first line must be its header "
            f'({{"type": "header", "format": "{FORMAT}", ...}}), got '
            f"{_abbreviate(raw)}",
        )
    if record.version != VERSION:
        newer = record.version > VERSION
        raise TraceError(
            path,
            1,
            f"trace format version {record.version} is "
            f"{'newer than' if newer else 'not'} the version this moriio-fsm reads "
            f"({VERSION}){'; upgrade moriio-fsm to read it' if newer else ''}",
        )


@dataclass
class Trace:
    """Every record of one or more trace files, in file order."""

    paths: list[str] = field(default_factory=list)
    headers: list[Header] = field(default_factory=list)
    tables: dict[tuple[str, str], TableInfo] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)

    def of_transfer(self, transfer_id: str) -> list[Step]:
        return [s for s in self.steps if s.transfer == transfer_id]


def read_trace(*paths: str | Path) -> Trace:
    """Load whole trace files (for tools and tests; ``replay`` streams instead)."""
    trace = Trace(paths=[str(p) for p in paths])
    for path in paths:
        for _, record in iter_records(path):
            if isinstance(record, Step):
                trace.steps.append(record)
            elif isinstance(record, TableInfo):
                trace.tables[(record.side, record.table)] = record
            elif isinstance(record, Header):
                trace.headers.append(record)
            else:
                trace.gaps.append(record)
    return trace
