"""Guards and actions both decode-side machines (WRITE consumer, READ consumer) bind under
one name.

They are what D tells vLLM about a load and how D holds its blocks and gives them back;
each counts itself in the context, so the specs' "reported once" and "freed once"
invariants see it.
"""

from __future__ import annotations

from ..runtime.bindings import Action, Bindings
from ..runtime.declared import emits
from .common import count_notify_failure, local_request_finished, note_request_finished


def report_received(tx, ev, out) -> None:
    tx.reported_received += 1
    out.append(emits.report_received(tx.transfer_id))


def report_failure(tx, ev, out) -> None:
    tx.reported_failure += 1
    out.append(emits.report_load_failure(tx.transfer_id, reason=tx.end_reason or "failed"))


def mark_request_finished(tx, ev, out) -> None:
    tx.request_finished = True
    out.append(emits.hold_blocks(tx.transfer_id))


def free_blocks(tx, ev, out) -> None:
    tx.blocks_freed += 1
    out.append(emits.free_blocks(tx.transfer_id, reason=tx.end_reason or "finished"))


def quarantining(name: str, reason: str) -> Action:
    """The action ``name``: keep D's blocks out of circulation for good, saying ``reason``,
    and fail the load with that reason if the request still waits for it.

    A closure, so a generated step calls it instead of inlining it: it runs at most once
    per transfer, on its way into an anomaly.
    """

    def quarantine(tx, ev, out) -> None:
        tx.blocks_quarantined += 1
        out.append(emits.quarantine_blocks(tx.transfer_id, reason=reason))
        if not tx.request_finished:
            tx.reported_failure += 1
            out.append(emits.report_load_failure(tx.transfer_id, reason=reason))

    quarantine.__name__ = quarantine.__qualname__ = name
    return quarantine


def bind_decode_reports(bindings: Bindings) -> None:
    """Register the shared decode-side guards and actions on one consumer spec's bindings."""
    bindings.guard(local_request_finished)
    for action in (
        report_received,
        report_failure,
        mark_request_finished,
        note_request_finished,
        free_blocks,
        count_notify_failure,
    ):
        bindings.action(action)
