"""Guards and actions of ``specs/watch_worker.yaml`` (one worker rank, step by step).

The rank's machine keeps only its step phase; each hook call is a step of its trace.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings

bindings = Bindings("watch_worker")


@bindings.action
def begin_step(tx, ev, out) -> None:
    tx.saving = False


@bindings.action
def mark_saving(tx, ev, out) -> None:
    tx.saving = True


@bindings.action
def end_step(tx, ev, out) -> None:
    tx.saving = False
