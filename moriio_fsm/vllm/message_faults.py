"""Control-message faults for fault runs: lose, duplicate or delay what a rank sends its peer.

Set by ``fault_injection`` (``message_loss_rate``, ``message_dup_rate``,
``message_delay_rate`` with ``message_delay_s``, and ``message_lose_first``: the first
message of one kind, such as ``write_done``); seeded, so a run can be repeated. A
delayed message waits on one timer thread (bounded: beyond ``MAX_DELAYED`` pending it is
sent at once). Faults apply on the sending side, before the transport encodes and checks
the message: what arrives is a message the transport accepted, just late, twice or never.
A delayed message the transport then refuses is logged as lost (the driver is not told,
as for any message lost on the way).
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ..logs import get_logger

log = get_logger("moriio_fsm.vllm")

MAX_DELAYED = 4096
KEYS = ("message_loss_rate", "message_dup_rate", "message_delay_rate", "message_delay_s")


def wants_message_faults(faults: dict) -> bool:
    return any(faults.get(key) for key in (*KEYS[:3], "message_lose_first"))


class MessageFaults:
    """Wraps ``send(destination, message)``; counts what it did in ``counts``."""

    def __init__(self, send: Callable[[Any, Any], None], faults: dict):
        self._send = send
        self.loss = float(faults.get("message_loss_rate", 0.0))
        self.dup = float(faults.get("message_dup_rate", 0.0))
        self.delay_rate = float(faults.get("message_delay_rate", 0.0))
        self.delay_s = float(faults.get("message_delay_s", 0.05))
        self._lose_first: str | None = faults.get("message_lose_first")
        self._chance = random.Random(faults.get("seed", 0) ^ 0x5EED)
        self._lock = threading.Lock()
        self._due: list[tuple[float, int, Any, Any]] = []
        self._order = itertools.count()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.counts = {"lost": 0, "duplicated": 0, "delayed": 0}
        self._thread = threading.Thread(target=self._run, name="moriio-fsm-msg-delay", daemon=True)
        self._thread.start()

    def send(self, destination: Any, message: Any) -> None:
        with self._lock:
            roll = self._chance.random()
            twice = self._chance.random() < self.dup
            late = self._chance.random() < self.delay_rate
            first = message.kind == self._lose_first
            if first:
                self._lose_first = None
            if first or roll < self.loss:
                self.counts["lost"] += 1
                log.info("vllm.fault_message_lost", kind=message.kind, transfer=message.transfer_id)
                return
            if late and len(self._due) < MAX_DELAYED:
                self.counts["delayed"] += 1
                delay = self.delay_s * (0.5 + self._chance.random())
                heapq.heappush(
                    self._due, (time.monotonic() + delay, next(self._order), destination, message)
                )
                self._wake.notify()
                late_sent = True
            else:
                late_sent = False
            if twice:
                self.counts["duplicated"] += 1
        if not late_sent:
            self._send(destination, message)
        if twice:
            self._send(destination, message)

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._due:
                    self._wake.wait()
                    continue
                wait = self._due[0][0] - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
                _, _, destination, message = heapq.heappop(self._due)
                self._lock.release()
                try:
                    self._send(destination, message)
                except Exception as exc:  # refused late (closed, full): a lost message
                    log.info("vllm.fault_delayed_not_sent", kind=message.kind, error=str(exc))
                finally:
                    self._lock.acquire()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._due.clear()
            self._wake.notify()
        self._thread.join(timeout=2.0)
