"""The stand-in's transfer threads: the part of mori that completes posted work asynchronously (its queue pairs
and completion thread), one thread per remote engine, so a peer that does not answer delays only its own work.

Rules: like native mori, it holds no reference to a ``TransferStatus``, only a weak one, and records a
use-after-free incident when it must write into a status Python has already freed; work of an engine that was
collected is dropped (its native side would be gone); a held transfer waits for its gate, others go in order
per remote engine. A thread starts with the first transfer to its engine and ends after a while with none.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from .faults import Gate
from .incidents import record as record_incident
from .mover import Mover, Region, RegionTable, RemoteRegion

__all__ = ["Transfer", "drain", "submit"]

_log = logging.getLogger("moriio_fsm.engines.mori_standin")

_SUCCESS = 0
_ERR_RDMA_OP = 13
_IDLE_S = 2.0


@dataclass(eq=False)
class Transfer:
    """Work posted by one batch: what to move and how its status ends."""

    status: weakref.ref  # the TransferStatus; Python owns it
    engine: weakref.ref  # the posting engine
    uid: int
    op: str
    local: Region
    local_table: RegionTable
    remote: RemoteRegion
    ranges: list[tuple[int, int, int]]
    mover: Mover
    failure: tuple[int, str] | None = None  # the error completion after ``ranges`` landed
    gate: Gate | None = None
    notify: bool = False  # the target records the transfer once it landed


class _TransferThread:
    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Condition()
        self._queue: deque[Transfer] = deque()
        self._thread: threading.Thread | None = None
        self._busy = False

    def submit(self, transfer: Transfer) -> None:
        if transfer.gate is not None and not transfer.gate.is_open:
            transfer.gate.when_open(lambda: self._enqueue(transfer))
            return
        self._enqueue(transfer)

    def _enqueue(self, transfer: Transfer) -> None:
        with self._lock:
            self._queue.append(transfer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._lock.wait(_IDLE_S)
                if not self._queue:
                    self._thread = None
                    self._lock.notify_all()
                    return
                transfer = self._queue.popleft()
                self._busy = True
            try:
                _complete(transfer)
            except Exception:  # one transfer's trouble must not end the thread every engine uses
                _log.exception(
                    "[mori stand-in] completing batch_%s uid %d raised", transfer.op, transfer.uid
                )
                _fail(transfer, "stand-in: the transfer thread raised while completing it")
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every transfer handed over (held ones aside) has completed; False if ``timeout_s`` ran out."""
        with self._lock:
            return self._lock.wait_for(self.idle, timeout_s)

    def idle(self) -> bool:
        return not self._queue and not self._busy


def _complete(transfer: Transfer) -> None:
    engine = transfer.engine()
    if engine is None:
        return  # the engine is gone, and with it its queues: nothing completes
    notify_as = (
        (engine.standin_key, transfer.uid) if transfer.notify and transfer.failure is None else None
    )
    problem = transfer.mover.move(
        transfer.op,
        transfer.local,
        transfer.local_table,
        transfer.remote,
        transfer.ranges,
        notify_as,
    )
    if problem is not None and problem.peer_unreachable:
        engine.standin_peer_unreachable(transfer.remote.engine_key, problem.message)
    del engine
    if problem is not None:
        code, message = _ERR_RDMA_OP, problem.message
    elif transfer.failure is not None:
        code, message = transfer.failure
    else:
        code, message = _SUCCESS, ""
    status = transfer.status()
    if status is None:
        record_incident(
            f"use after free: batch_{transfer.op} uid {transfer.uid} completed with code {code} "
            "into a TransferStatus that Python had already freed (native mori would write into "
            "freed memory)"
        )
        return
    status.update(code, message)


def _fail(transfer: Transfer, message: str) -> None:
    status = transfer.status()
    if status is not None:
        status.update(_ERR_RDMA_OP, message)


_MAX_IDLE_THREADS = 256


class _QueuePairs:
    """The transfer threads by remote engine; idle ones beyond ``_MAX_IDLE_THREADS`` are forgotten."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[tuple, _TransferThread] = {}

    def thread_for(self, remote: RemoteRegion) -> _TransferThread:
        key = (remote.engine_key, remote.host, remote.port, remote.pid)
        with self._lock:
            thread = self._threads.get(key)
            if thread is None:
                if len(self._threads) >= _MAX_IDLE_THREADS:
                    self._threads = {k: t for k, t in self._threads.items() if not t.idle()}
                thread = self._threads[key] = _TransferThread(f"mori-standin-qp-{remote.port}")
            return thread

    def all(self) -> list[_TransferThread]:
        with self._lock:
            return list(self._threads.values())


_QUEUE_PAIRS = _QueuePairs()


def submit(transfer: Transfer) -> None:
    """Hand ``transfer`` to its remote engine's transfer thread; it completes later, on that thread."""
    _QUEUE_PAIRS.thread_for(transfer.remote).submit(transfer)


def drain(timeout_s: float = 30.0) -> bool:
    """Wait until the transfer threads have completed everything handed to them (transfers a closed gate holds
    are not handed over yet); False if ``timeout_s`` ran out first. For tests and benchmarks that free memory
    next."""
    deadline = time.monotonic() + timeout_s
    return all(thread.drain(max(0.0, deadline - time.monotonic())) for thread in _QUEUE_PAIRS.all())
