"""The watch on one worker rank: each hook call is one event of the rank's ``watch_worker``
machine, dispatched after the inner connector answered.

Rules: one transfer per rank, named by the rank; the rank's steps stay in its flight
recorder (a ring, never a file: a step per layer per engine step is too many to write).
A failure of the watch is logged once and never reaches vLLM.
"""

from __future__ import annotations

import time
from typing import Any

from ..logs import get_logger
from ..machines import build_table
from ..runtime.declared import events

log = get_logger("moriio_fsm.vllm.watch")


class WorkerWatch:
    """The ``watch_worker`` machine of one rank."""

    def __init__(self, rank: str, recorder: Any, clock=time.monotonic):
        self.rank = rank
        self.clock = clock
        self.recorder = recorder
        self.table = build_table("watch_worker", recorder=recorder)
        self._failed = False
        self._dispatch(events.worker_started(rank, clock()))

    def _dispatch(self, ev: Any) -> None:
        try:
            self.table.dispatch(ev)
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("watch.worker_step_failed", rank=self.rank, event=ev.kind)

    def step_bound(self) -> None:
        self._dispatch(events.step_bound(self.rank, self.clock()))

    def load_started(self) -> None:
        self._dispatch(events.load_started(self.rank, self.clock()))

    def layer_saved(self, layer_name: Any) -> None:
        name = layer_name if isinstance(layer_name, str) else repr(layer_name)
        self._dispatch(events.layer_saved(self.rank, self.clock(), layer_name=name[:256]))

    def saves_waited(self) -> None:
        self._dispatch(events.saves_waited(self.rank, self.clock()))

    def finished(self, answer: Any) -> None:
        sending, recving = answer if isinstance(answer, tuple) and len(answer) == 2 else (0, 0)
        self._dispatch(
            events.finished_reported(
                self.rank, self.clock(), sending=_count(sending), recving=_count(recving)
            )
        )

    def load_errors(self, blocks: Any) -> None:
        count = _count(blocks)
        if count:
            self._dispatch(events.load_errors_reported(self.rank, self.clock(), blocks=count))

    def step_cleared(self) -> None:
        self._dispatch(events.step_cleared(self.rank, self.clock()))

    def close(self) -> None:
        self._dispatch(events.worker_closed(self.rank, self.clock()))


def _count(value: Any) -> int:
    try:
        return len(value) if value else 0
    except TypeError:
        return 0
