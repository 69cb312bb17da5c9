"""What the worker tells vLLM about finished transfers, held to vLLM's once-only rules.

vLLM's scheduler asserts that every id in ``finished_sending`` / ``finished_recving`` is a
request it knows, and treats a repeat as a crash. The machines decide *when* a request is
reported; this ledger only makes the rules impossible to break: an id is reported once,
and only after vLLM said it waits for it (``expect_*``). Anything else is counted, logged
and dropped. Handlers on several threads report; one lock guards the sets.
"""

from __future__ import annotations

import threading

from ..logs import get_logger

log = get_logger("moriio_fsm.vllm")


class VllmReports:
    """The per-step sets the worker hands vLLM, and the ids vLLM waits for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._awaiting_send: set[str] = set()  # P: vLLM keeps these blocks for us
        self._awaiting_recv: set[str] = set()  # D: vLLM waits for these loads
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.refused = 0  # reports vLLM did not wait for
        # Called after a load ended: wakes the loop that may be waiting for a write to help
        # with (copy assist), so that the report reaches vLLM at once.
        self.on_load_ended = None

    def expect_sending(self, request_id: str) -> None:
        with self._lock:
            self._awaiting_send.add(request_id)

    def expect_recving(self, request_id: str) -> None:
        with self._lock:
            self._awaiting_recv.add(request_id)

    def sent(self, request_id: str) -> bool:
        """P's blocks of ``request_id`` may be freed; True when reported now."""
        with self._lock:
            if request_id in self._awaiting_send:
                self._awaiting_send.discard(request_id)
                self._sending.add(request_id)
                return True
            self.refused += 1
        log.debug("vllm.report_refused", request_id=request_id, why="vLLM does not wait for it")
        return False

    def received(self, request_id: str, failed_blocks: tuple[int, ...] = ()) -> bool:
        """D's load of ``request_id`` ended (its blocks listed when it failed)."""
        with self._lock:
            known = request_id in self._awaiting_recv
            if known:
                self._awaiting_recv.discard(request_id)
                self._recving.add(request_id)
                self._load_errors.update(failed_blocks)
            else:
                self.refused += 1
        if known and self.on_load_ended is not None:
            self.on_load_ended()
        return known

    def awaits(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._awaiting_send or request_id in self._awaiting_recv

    def loads_pending(self) -> bool:
        """D: vLLM waits for a load, and none has ended since the last report."""
        with self._lock:
            return bool(self._awaiting_recv) and not self._recving

    def take(self) -> tuple[set[str], set[str]]:
        """This step's reports (vLLM's ``get_finished``), cleared as they are handed over."""
        with self._lock:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
        return sending, recving

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return {
                "awaiting_send": len(self._awaiting_send),
                "awaiting_recv": len(self._awaiting_recv),
            }
