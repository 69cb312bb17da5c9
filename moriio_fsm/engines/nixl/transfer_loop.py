"""The NIXL engine's thread: each posted transfer built, posted, polled, cancelled and released in NIXL.

Rules: only this thread moves bytes and progresses UCX, between sleeps that back off while nothing
settles; every NIXL call holds the agent lock; a handle NIXL could not release stays referenced.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from ..inflight import PostQueue, closed_text
from ..status import StatusCode
from .agent import lingering
from .session import Transfer

__all__ = ["TransferLoop"]

# The engine's logger: its warnings read as the engine's, wherever the code sits.
_log = logging.getLogger("moriio_fsm.engines.nixl.engine")


class TransferLoop:
    """The engine thread's part of ``NixlEngine`` (a base class of it): ``_run`` is the thread."""

    key: str
    _agent: Any
    _agent_lock: threading.Lock
    _queue: PostQueue[Transfer]
    _transfer_timeout_s: float
    _idle_progress_s: float
    _min_poll_s: float
    _stuck: bool

    def _finish(
        self, posted: Transfer, code: int, message: str = "", *, transport_failed: bool = False
    ) -> None:
        raise NotImplementedError  # the engine's: it settles a transfer and lets go of its uses

    def _run(self) -> None:
        active: list[Transfer] = []
        pause = self._min_poll_s
        while (
            incoming := self._queue.take(pause if active else self._idle_progress_s)
        ) is not None:
            for posted in incoming:
                if self._start(posted):
                    active.append(posted)
            if active:
                before = len(active)
                active = [posted for posted in active if not self._check(posted)]
                pause = (
                    self._min_poll_s
                    if incoming or len(active) < before
                    else min(pause * 2, self._idle_progress_s)
                )
            else:
                self._progress()
        self._abandon(active)

    def _start(self, posted: Transfer) -> bool:
        """Build and post one NIXL transfer request; True while it is in flight."""
        session = posted.session
        reason = session.why_dead()
        if reason is not None:
            self._finish(posted, StatusCode.ERR_RDMA_OP, reason)
            return False
        batch = posted.batch
        count = len(batch.sizes)
        local = np.empty((count, 3), dtype=np.uint64)
        local[:, 0] = np.asarray(batch.local_offsets, dtype=np.uint64) + np.uint64(
            session.local_mem.address
        )
        local[:, 1] = batch.sizes
        local[:, 2] = 0
        remote = local.copy()
        remote[:, 0] = np.asarray(batch.remote_offsets, dtype=np.uint64) + np.uint64(
            session.remote_mem.address
        )
        peer_name = self.key if session._peer is None else session.remote_engine_key
        with self._agent_lock:
            try:
                local_descs = self._agent.get_xfer_descs(local, "DRAM")
                remote_descs = self._agent.get_xfer_descs(remote, "DRAM")
                posted.handle = self._agent.initialize_xfer(
                    posted.op.upper(), local_descs, remote_descs, peer_name
                )
            except Exception as exc:
                not_found = "NotFound" in type(exc).__name__
                self._finish(
                    posted,
                    StatusCode.ERR_NOT_FOUND if not_found else StatusCode.ERR_BAD_STATE,
                    f"NIXL refused the transfer request: {type(exc).__name__}: {exc}",
                )
                return False
            try:
                state = self._agent.transfer(posted.handle)
            except Exception as exc:
                state = f"ERR ({type(exc).__name__}: {exc})"
        posted.deadline = time.monotonic() + self._transfer_timeout_s
        return not self._settle_if_final(posted, state)

    def _check(self, posted: Transfer) -> bool:
        """Poll one transfer; True once it is final (settled)."""
        with self._agent_lock:
            try:
                state = self._agent.check_xfer_state(posted.handle)
            except Exception as exc:
                state = f"ERR ({type(exc).__name__}: {exc})"
        if self._settle_if_final(posted, state):
            return True
        if time.monotonic() < posted.deadline:
            return False
        if self._cancel(posted):
            self._finish(
                posted,
                StatusCode.ERR_RDMA_OP,
                f"not complete after {self._transfer_timeout_s:g} s; cancelled",
            )
            return True
        if not posted.cancel_failed:
            posted.cancel_failed = True
            _log.warning(
                "%s of engine %r: NIXL could not cancel it after %g s; it stays in progress",
                posted.label,
                self.key,
                self._transfer_timeout_s,
            )
        posted.deadline = time.monotonic() + 1.0  # try to cancel again later
        return False

    def _settle_if_final(self, posted: Transfer, state: str) -> bool:
        if state == "PROC":
            return False
        if state == "DONE":
            self._release(posted)
            self._finish(posted, StatusCode.SUCCESS)
        else:
            self._release(posted)
            self._finish(
                posted,
                StatusCode.ERR_RDMA_OP,
                f"NIXL reported the transfer failed ({state}): the peer is gone or the transport broke",
                transport_failed=True,
            )
        return True

    def _release(self, posted: Transfer) -> None:
        with self._agent_lock:
            try:
                self._agent.release_xfer_handle(posted.handle)
            except Exception as exc:
                _log.warning(
                    "%s of engine %r: releasing its NIXL handle failed: %s",
                    posted.label,
                    self.key,
                    exc,
                )
                lingering.append(posted.handle)

    def _cancel(self, posted: Transfer) -> bool:
        """Release an unfinished request (NIXL cancels it); False when NIXL could not."""
        with self._agent_lock:
            try:
                self._agent.release_xfer_handle(posted.handle)
            except Exception:
                return False
        return True

    def _progress(self) -> None:
        """Progress UCX with nothing of our own in flight, so peers' transfers into this engine move."""
        with self._agent_lock:
            try:
                self._agent.get_new_notifs()
            except Exception as exc:  # never let progress end the worker thread
                _log.warning("NIXL progress of engine %r failed: %s", self.key, exc)

    def _abandon(self, active: list[Transfer]) -> None:
        """At close: fail what is in flight; what cannot be cancelled keeps its resources."""
        for posted in active:
            if self._cancel(posted):
                self._finish(posted, StatusCode.ERR_BAD_STATE, closed_text(self.key))
            else:
                lingering.append(posted.handle)
                self._stuck = True
                self._finish(
                    posted,
                    StatusCode.ERR_BAD_STATE,
                    closed_text(self.key) + " (NIXL could not cancel it)",
                )
