"""Posting together: the layers a thread posts inside one dispatch go to the engine at once.

Rules: inside ``together(engine)`` a thread's posts are collected and handed to the engine
when the outermost block ends (one kernel call for a transfer's layers on the same-host
engine); a completion the engine already knows is dispatched on that thread, the others go
to the completion poller. Every completion's event is made before any is dispatched, so
each carries the time its copy ended. Threads never share a collection.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from ..engines.poller import CompletionPoller
from ..logs import get_logger
from ..runtime.events import Event

log = get_logger("moriio_fsm.vllm")


class _ThreadPosts(threading.local):
    collected: list | None = None  # this thread's posts awaiting their flush, inside a block


class PostBatcher:
    """Collects each thread's posts inside ``together`` and delivers their completions."""

    def __init__(self, poller: CompletionPoller, deliver: Callable[[Event], object]):
        self._poller = poller
        self._deliver = deliver
        self._posts = _ThreadPosts()

    @contextlib.contextmanager
    def together(self, engine: Any):
        """Posts made on this thread until the block ends go to ``engine`` together."""
        local = self._posts
        if engine is None or local.collected is not None:
            yield  # no engine yet, or an outer block of this thread flushes
            return
        local.collected = []
        try:
            with engine.posting_together():
                yield
        finally:
            collected, local.collected = local.collected, None
            completed = [(self._poller.event_if_final(*posted), posted) for posted in collected]
            for event, posted in completed:
                self._complete(event, *posted)

    def completion_of(self, status, transfer_id: str, layer: int, op: str) -> Event | None:
        """A posted layer's completion event for the handler to return, if the engine already
        finished it (copied as it posted); else None, and the completion comes later: from
        this thread's block once its posts went together, or from the poller."""
        event = self._poller.event_if_final(status, transfer_id, layer, op)
        if event is not None:
            return event
        collected = self._posts.collected
        if collected is not None:
            collected.append((status, transfer_id, layer, op))
        else:
            self._poller.submit(status, transfer_id, layer, op)
        return None

    def _complete(self, event: Event | None, status, transfer_id: str, layer: int, op: str) -> None:
        if event is None:
            try:
                self._poller.submit(status, transfer_id, layer, op)
            except RuntimeError:  # closing: nothing waits for this completion any more
                pass
            return
        try:
            self._deliver(event)
        except Exception:  # the other layers' completions still go out
            log.exception("vllm.completion_failed", transfer_id=transfer_id, layer=layer)
