"""Guards and actions of ``specs/watch_consumer.yaml`` (what D's scheduler sees of a load).

Every function is a small, pure step over the transfer's context. Anomalies are effects
(``note_anomaly``) the watch's adapter logs and counts; nothing here acts on vLLM.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings
from ..runtime.declared import emits

bindings = Bindings("watch_consumer")


@bindings.guard
def first_request(tx, ev) -> bool:
    return tx.num_tokens == 0


@bindings.guard
def loads_blocks(tx, ev) -> bool:
    return len(ev.block_ids) > 0


@bindings.guard
def report_noted(tx, ev) -> bool:
    return tx.reports >= 2


@bindings.guard
def failure_noted(tx, ev) -> bool:
    return tx.failures >= 1


@bindings.guard
def stuck_noted(tx, ev) -> bool:
    return tx.stuck


@bindings.guard
def holds_failed_block(tx, ev) -> bool:
    mine = tx.block_ids
    return bool(mine) and not set(mine).isdisjoint(ev.block_ids)


@bindings.action
def init_load(tx, ev, out) -> None:
    tx.num_tokens = max(1, ev.num_tokens)


@bindings.action
def take_blocks(tx, ev, out) -> None:
    tx.block_ids = tuple(ev.block_ids)
    tx.blocks = len(tx.block_ids)


@bindings.action
def count_report(tx, ev, out) -> None:
    tx.reports = min(tx.reports + 1, 2)


@bindings.action
def count_failure(tx, ev, out) -> None:
    tx.failures += 1
    tx.anomalies += 1
    detail = "load reported failed" if ev.kind == "recv_failed" else "blocks failed to load"
    out.append(emits.note_anomaly(tx.transfer_id, anomaly="load_error", detail=detail))


@bindings.action
def note_not_waiting(tx, ev, out) -> None:
    tx.reports = 2  # noted once: later reports are duplicates
    tx.anomalies += 1
    out.append(
        emits.note_anomaly(
            tx.transfer_id,
            anomaly="unexpected_report",
            detail="finished loading reported before vLLM allocated its blocks",
        )
    )


@bindings.action
def note_second_report(tx, ev, out) -> None:
    tx.reports = 2
    tx.anomalies += 1
    out.append(
        emits.note_anomaly(
            tx.transfer_id, anomaly="second_report", detail="the load was reported finished again"
        )
    )


@bindings.action
def note_stuck(tx, ev, out) -> None:
    tx.stuck = True
    tx.anomalies += 1
    out.append(
        emits.note_anomaly(
            tx.transfer_id,
            anomaly="stuck_load",
            detail="no finished report within stuck_after_s",
        )
    )


@bindings.action
def count_note_failure(tx, ev, out) -> None:
    tx.note_failures += 1


@bindings.action
def mark_aborted(tx, ev, out) -> None:
    tx.aborted = True


@bindings.action
def end_transfer(tx, ev, out) -> None:
    tx.ended += 1
    if tx.failures:
        outcome = "load_failed"
    elif tx.aborted:
        outcome = "aborted"
    else:
        outcome = "received" if tx.reports else "no_load"
    out.append(emits.transfer_ended(tx.transfer_id, outcome=outcome, stuck=tx.stuck))
