"""Guards and actions of ``specs/watch_producer.yaml`` (what P's scheduler sees of a send).

Every function is a small, pure step over the transfer's context. Anomalies are effects
(``note_anomaly``) the watch's adapter logs and counts; nothing here acts on vLLM.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings
from ..runtime.declared import emits

bindings = Bindings("watch_producer")


@bindings.guard
def delays_free(tx, ev) -> bool:
    return ev.held is True


@bindings.guard
def report_noted(tx, ev) -> bool:
    return tx.reports >= 2


@bindings.guard
def stranded_noted(tx, ev) -> bool:
    return tx.stranded


@bindings.action
def hold_blocks(tx, ev, out) -> None:
    tx.held += 1


@bindings.action
def count_report(tx, ev, out) -> None:
    tx.reports = min(tx.reports + 1, 2)


@bindings.action
def note_not_waiting(tx, ev, out) -> None:
    tx.reports = 2  # noted once: later reports are duplicates
    tx.anomalies += 1
    out.append(
        emits.note_anomaly(
            tx.transfer_id,
            anomaly="unexpected_report",
            detail="finished sending reported while the request still ran",
        )
    )


@bindings.action
def note_second_report(tx, ev, out) -> None:
    tx.reports = 2
    tx.anomalies += 1
    out.append(
        emits.note_anomaly(
            tx.transfer_id, anomaly="second_report", detail="the send was reported finished again"
        )
    )


@bindings.action
def note_stranded(tx, ev, out) -> None:
    tx.stranded = True
    tx.anomalies += 1
    out.append(
        emits.note_anomaly(
            tx.transfer_id,
            anomaly="stranded_kv",
            detail="blocks held for sending past stranded_after_s",
        )
    )


@bindings.action
def count_note_failure(tx, ev, out) -> None:
    tx.note_failures += 1


@bindings.action
def end_transfer(tx, ev, out) -> None:
    tx.ended += 1
    outcome = "sent" if tx.reports else "not_held"
    out.append(emits.transfer_ended(tx.transfer_id, outcome=outcome, stuck=tx.stranded))
