"""What a table calls after each step: the two kinds of recorder a table accepts.

Rules: a plain recorder sees each event with its result; a step recorder is bound to the
table once and then sees every step (state before, result, rows taken) under the shard lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .events import Event, Result

__all__ = ["Recorder", "StepRecord", "StepRecorder"]

Recorder = Callable[[Event, Result], None]
#: What a step recorder's ``bind_table(table)`` returns: called as
#: ``record(event, state_before, result, rows)`` under the shard lock after every step;
#: ``result`` is None when the step raised (``error`` then carries the exception) and
#: ``rows`` is the tuple of spec rows taken (None with the transitions executor).
StepRecord = Callable[..., None]


class StepRecorder(Protocol):
    """A step recorder: ``bind_table(table)`` returns its ``StepRecord`` for the table."""

    def bind_table(self, table: Any) -> StepRecord | None: ...
