"""Actions both decode-side machines (WRITE consumer, READ consumer) bind under one name.

They are what D tells vLLM about a load and how D gives its blocks back; each counts
itself in the context, so the specs' "reported once" and "freed once" invariants see it.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings
from ..runtime.declared import emits


def report_received(tx, ev, out) -> None:
    tx.reported_received += 1
    out.append(emits.report_received(tx.transfer_id))


def report_failure(tx, ev, out) -> None:
    tx.reported_failure += 1
    out.append(emits.report_load_failure(tx.transfer_id, reason=tx.end_reason or "failed"))


def free_blocks(tx, ev, out) -> None:
    tx.blocks_freed += 1
    out.append(emits.free_blocks(tx.transfer_id, reason=tx.end_reason or "finished"))


def count_notify_failure(tx, ev, out) -> None:
    tx.notify_failures += 1


def bind_decode_reports(bindings: Bindings) -> None:
    """Register the shared decode-side actions on one consumer spec's bindings."""
    for action in (report_received, report_failure, free_blocks, count_notify_failure):
        bindings.action(action)
