"""The trace file format (version 1): JSON Lines of typed records, and their encoding.

Rules: every file starts with a ``header`` line naming the format and its version; then
``table`` lines (what each traced table was built with) and ``step`` lines (one per
dispatch), and ``gap`` lines where a writer had to drop records. Each line is one JSON
object tagged by ``type``; unknown fields are ignored, so a newer writer's extra fields
do not break an older reader, but a newer *version* is refused. ``docs/trace-format.md``
is the user-facing description of every field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

FORMAT = "moriio-fsm-trace"
VERSION = 1
#: A line longer than this is refused rather than read (a hostile or broken file).
MAX_LINE_BYTES = 1 << 20
#: A record nested deeper than this (objects and arrays within each other, the record
#: itself the first level) is refused: real records nest a few levels, and a deeper one
#: would make every tool that walks it recurse without bound.
MAX_NESTING = 64
#: The outcome a step gets when a binding raised or an invariant broke (it was rolled back).
RAISED = "raised"


class Header(msgspec.Struct, tag="header", tag_field="type", omit_defaults=True):
    """The first line of every trace file."""

    format: str
    version: int
    writer: str = ""  # one id per writer instance (its parts share it)
    part: int = 0  # rotation: 0 for the first file a writer opened, then 1, 2...
    pid: int = 0
    host: str = ""
    created: float = 0.0  # wall clock (seconds since the epoch) when the file was opened


class TableInfo(msgspec.Struct, tag="table", tag_field="type", omit_defaults=True):
    """What one traced table was built with, so a replay can build the same one."""

    side: str
    table: str  # the table's key within its side (its spec name, or name#2...)
    spec: str  # the spec's name
    spec_path: str = ""  # the file it was loaded from
    spec_sha256: str = ""  # digest of that file's bytes when recorded
    executor: str = "compiled"
    config: dict[str, Any] = {}
    options: dict[str, Any] = {}


class _StepFields(msgspec.Struct, omit_defaults=True):
    """The fields of a step line that say what happened (``Step`` adds who wrote it)."""

    seq: Annotated[int, msgspec.Meta(ge=0)]
    side: str
    table: str
    transfer: str
    event: str
    t: float
    outcome: str
    data: dict[str, Any] = {}
    source: str = ""
    before: str | None = None
    after: str | None = None
    rows: tuple[int, ...] | None = None
    actions: list[str] | None = None
    effects: list[dict[str, Any]] = []
    error: str | None = None
    link: str = ""  # the key both sides' transfers of one request share
    wall: float | None = None

    @property
    def link_key(self) -> str:
        return self.link or self.transfer


class Step(_StepFields, tag="step", tag_field="type", omit_defaults=True):
    """One dispatch: the event, the state before and after, the rows, effects and outcome.

    ``rows`` and ``actions`` are None when the table ran the transitions executor (which
    does not say which row fired). ``outcome`` is an ``Outcome`` value or ``"raised"``
    (then ``error`` says what; the step was rolled back, so ``after == before``).
    ``t`` is the event's time, the host's monotonic clock by the runtime's contract;
    ``wall`` is derived from it and the clocks read once when the recorder started, so
    the steps of one process never go back in time and sides line up on the wall clock.
    """

    pid: int | None = None
    thread: str | None = None


class ReplayStep(_StepFields, tag="step", tag_field="type", omit_defaults=True):
    """A step as replay reads it: every field it checks or reports, not who wrote it
    (``pid``, ``thread``), so decoding skips those."""


class Gap(msgspec.Struct, tag="gap", tag_field="type", omit_defaults=True):
    """A writer dropped ``dropped`` records of ``side`` (its queue was full or its disk
    failed); steps after ``after_seq`` may miss some of their predecessors."""

    side: str
    dropped: int
    after_seq: int = 0
    reason: str = ""


Record = Header | TableInfo | Step | Gap

_encoder = msgspec.json.Encoder(enc_hook=repr)
#: Decodes one line into its record (``Header``, ``TableInfo``, ``Step`` or ``Gap``).
DECODER = msgspec.json.Decoder(Record)
#: The same, with steps as ``ReplayStep``.
REPLAY_DECODER = msgspec.json.Decoder(Header | TableInfo | ReplayStep | Gap)


def encode_line(record: Record) -> bytes:
    """One record as one JSON line (with its newline)."""
    return _encoder.encode(record) + b"\n"


def decode_line(line: bytes) -> Record:
    """One JSON line as a record; ``msgspec.DecodeError`` / ``ValidationError`` otherwise."""
    return DECODER.decode(line)


def new_header(writer: str = "", part: int = 0) -> Header:
    import os
    import socket
    import time

    return Header(
        FORMAT,
        VERSION,
        writer=writer,
        part=part,
        pid=os.getpid(),
        host=socket.gethostname(),
        created=time.time(),
    )
