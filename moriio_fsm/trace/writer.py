"""Writing trace files: ``write_trace`` at once, or ``TraceWriter`` on a thread of its own.

Rules: ``TraceWriter.submit`` is what a dispatching thread calls; it only appends to a
bounded queue (when the queue is full the record is dropped and counted, and the file
later gets a ``gap`` line saying how many). Rendering, every file operation and rotation
happen on the writer's thread. A failing disk never reaches the dispatching thread: the
error is counted and logged, the lines in hand are dropped (a gap line follows), and the
writer tries again with the next batch. Rotation keeps ``backups`` older files
(``trace.jsonl.1`` is the newest of them); every file starts with its own header and
describes each table again before its first step, so any part can be read alone.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from .format import Gap, Record, encode_line, new_header
from .render import SEQ, Processor, StepRenderer, meta_of

log = logging.getLogger("moriio_fsm.trace")


def write_trace(path: str | Path, records: Iterable[Record | dict], *, writer: str = "") -> int:
    """Write a whole trace file now: a header, then ``records`` (``Step``, ``TableInfo``,
    ``Gap``, or dicts of their fields with ``"type"``). Returns the number of records."""
    count = 0
    with open(path, "wb") as handle:
        handle.write(encode_line(new_header(writer or uuid.uuid4().hex[:12])))
        for record in records:
            if isinstance(record, dict):
                record = msgspec.convert(record, Record)
            handle.write(encode_line(record))
            count += 1
    return count


class _Flush:
    """A marker in the queue: set once everything queued before it is written."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class TraceWriter:
    """Appends trace records to ``path`` from a background thread.

    ``max_bytes`` starts a new file when the current one would grow past it, keeping
    ``backups`` older ones; ``queue_limit`` bounds the records waiting to be written;
    ``flush_interval`` is how often (seconds) the thread wakes to write; ``processors``
    are structlog processors run on every step before it is rendered.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 64 << 20,
        backups: int = 5,
        queue_limit: int = 65536,
        flush_interval: float = 0.05,
        processors: Iterable[Processor] = (),
    ):
        for name, value, low in (
            ("max_bytes", max_bytes, 4096),
            ("backups", backups, 0),
            ("queue_limit", queue_limit, 1),
        ):
            if type(value) is not int or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(flush_interval, (int, float)) and 0 < flush_interval <= 60):
            raise ValueError(f"flush_interval must be in (0, 60] seconds, got {flush_interval!r}")
        self.path = Path(path)
        folder = self.path.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ValueError(
                f"cannot write trace files to {self.path}: {folder} is not a writable folder"
            )
        self.max_bytes, self.backups = max_bytes, backups
        self.id = uuid.uuid4().hex[:12]
        self.written = 0  # step lines written
        self.dropped = 0  # records dropped (queue full or disk failure)
        self.write_errors = 0
        self.render_errors = 0
        self._queue: deque = deque()
        self._limit = queue_limit
        self._interval = flush_interval
        self._renderer = StepRenderer(processors)
        self._drop_lock = threading.Lock()
        self._gap_side = ""
        self._reported_drops = 0
        self._last_seq = 0
        self._handle: BinaryIO | None = None
        self._part_has_steps = False  # whether the open part holds a step line
        self._bytes = 0
        self._part = 0
        self._described: set[int] = set()  # ids of the table metas this part described
        self._wake = threading.Event()
        self._closing = False
        self.thread = threading.Thread(
            target=self._run, name=f"moriio-fsm-trace-writer-{self.id}", daemon=True
        )
        self.thread.start()
        atexit.register(_close_if_alive, weakref.ref(self))

    # -- called from any thread ------------------------------------------------------------

    def submit(self, raw: tuple) -> None:
        """Queue one raw record (the dispatching thread's only cost)."""
        if len(self._queue) < self._limit:
            self._queue.append(raw)
        else:
            self._drop(raw, 1)

    def submit_many(self, raws: list) -> None:
        room = self._limit - len(self._queue)
        if room >= len(raws):
            self._queue.extend(raws)
            return
        self._queue.extend(raws[: max(0, room)])
        self._drop(raws[max(0, room)], len(raws) - max(0, room))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is written (or ``timeout``); False
        when the writer did not get there in time or has stopped."""
        if not self.thread.is_alive():
            return not self._queue
        marker = _Flush()
        self._queue.append(marker)
        self._wake.set()
        return marker.done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, close the file and stop the thread (idempotent)."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        return {
            "written": self.written,
            "dropped": self.dropped,
            "queued": len(self._queue),
            "write_errors": self.write_errors,
            "render_errors": self.render_errors,
            "part": self._part,
        }

    # -- the writer's thread ---------------------------------------------------------------

    def _drop(self, raw: tuple, count: int) -> None:
        with self._drop_lock:
            if self.dropped == self._reported_drops:
                self._gap_side = meta_of(raw).side
            self.dropped += count

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            closing = self._closing
            self._drain()
            if closing:
                break
        self._close_file()

    def _drain(self) -> None:
        queue = self._queue
        lines: list[tuple[Any, bytes]] = []
        markers: list[_Flush] = []
        while queue:
            item = queue.popleft()
            if item.__class__ is _Flush:
                markers.append(item)
                self._write(lines)
                lines = []
                continue
            try:
                line = self._renderer.line(item)
            except Exception as exc:  # a user processor or an unrenderable value
                self.render_errors += 1
                if self.render_errors <= 10:
                    log.error(
                        "trace writer %s: cannot render step seq %s: %s: %s",
                        self.path,
                        item[SEQ],
                        type(exc).__name__,
                        exc,
                    )
                continue
            lines.append((meta_of(item), line))
            self._last_seq = item[SEQ]
            if len(lines) >= 4096:
                self._write(lines)
                lines = []
        self._write(lines)
        for marker in markers:
            marker.done.set()

    def _write(self, lines: list[tuple[Any, bytes]]) -> None:
        """Write step lines, each after its table's description where this part lacks it,
        starting a new part first when the line would not fit."""
        if not lines and self.dropped == self._reported_drops:
            return
        done = 0
        try:
            handle = self._ensure_open()
            if self.dropped != self._reported_drops:
                with self._drop_lock:
                    missing = self.dropped - self._reported_drops
                    self._reported_drops = self.dropped
                handle.write(
                    encode_line(
                        Gap(
                            self._gap_side,
                            missing,
                            self._last_seq,
                            "the writer's queue was full or its disk failed",
                        )
                    )
                )
            for meta, line in lines:
                if self._bytes + len(line) > self.max_bytes and self._part_has_steps:
                    handle = self._rotate()
                if id(meta) not in self._described:
                    info = encode_line(meta.info)
                    handle.write(info)
                    self._bytes += len(info)
                    self._described.add(id(meta))
                handle.write(line)
                self._bytes += len(line)
                self._part_has_steps = True
                done += 1
            handle.flush()
            self.written += done
        except OSError as exc:
            self.write_errors += 1
            # Lines handed to a failing file may or may not have reached the disk: all of
            # this batch counts as dropped, so the gap line overstates rather than hides.
            lost = len(lines)
            with self._drop_lock:
                if self.dropped == self._reported_drops and lines:
                    self._gap_side = lines[0][0].side
                self.dropped += lost
            if self.write_errors <= 10 or self.write_errors % 1000 == 0:
                log.error(
                    "trace writer %s: write failed (%d so far), %d record(s) dropped: %s",
                    self.path,
                    self.write_errors,
                    lost,
                    exc,
                )
            self._close_file()

    def _ensure_open(self) -> BinaryIO:
        """The open part, opened (with its header) when there is none."""
        if self._handle is not None:
            return self._handle
        handle = open(self.path, "ab")
        self._handle = handle
        self._bytes = handle.tell()
        self._described = set()
        self._part_has_steps = False
        if self._bytes == 0:
            header = encode_line(new_header(self.id, self._part))
            handle.write(header)
            self._bytes = len(header)
        return handle

    def _rotate(self) -> BinaryIO:
        """Close the part, shift the backups, and return the new part, opened."""
        self._close_file()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for index in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{index}")
                if older.exists():
                    older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._part += 1
        return self._ensure_open()

    def _close_file(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass


def _close_if_alive(ref: weakref.ref[TraceWriter]) -> None:
    """At exit: close the writer if it still exists (the hook holds no strong reference)."""
    writer = ref()
    if writer is not None:
        writer.close()
