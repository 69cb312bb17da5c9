"""What is wrong in a replayed trace besides divergences: the anomaly list of ``replay``.

Rules: each anomaly names the side, table and transfer and says what was seen and
when. Per transfer: not final when the trace ends (state, for how long, last event),
ended in an anomaly state, events the spec rejected, steps that raised (invariant
violations, binding errors), a once-only effect (``facts.py``) emitted twice. Across
sides, for the requests traced on more than one side: a once-only message sent by one
side that no other side's trace shows arriving, or one that arrived with no other side
showing it sent. Gaps a writer left are anomalies too: what follows them may not replay.
Transfers whose trace starts mid-way (partial) are not judged.
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import once_only_effects


@dataclass(frozen=True)
class Anomaly:
    kind: str  # not_final, anomaly_state, rejected, raised, twice, unmatched, gap
    where: str  # "side/table 'transfer'" or the side
    message: str
    transfer: str = ""
    link: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.where}: {self.message}"


def find_anomalies(report) -> list[Anomaly]:
    found: list[Anomaly] = []
    for gap in report.gaps:
        found.append(
            Anomaly(
                "gap",
                gap.side or "(writer)",
                f"the trace writer dropped {gap.dropped} record(s) after seq "
                f"{gap.after_seq} ({gap.reason or 'no reason given'}); transfers "
                "active then may not replay exactly",
            )
        )
    by_link: dict[str, list] = {}
    for key, summary in report.transfers.items():
        if summary.partial:
            continue
        by_link.setdefault(summary.link, []).append(summary)
        found.extend(_of_transfer(report, key, summary))
    for link, group in by_link.items():
        if len({s.side for s in group}) > 1:
            found.extend(_across_sides(link, group))
    return found


def _of_transfer(report, key, summary) -> list[Anomaly]:
    found = []
    who, spec = summary.who, summary.spec
    # Where the traces end (the last step of any side), on this transfer's side's clock.
    end = summary.since + (report.end_wall - summary.since_wall)

    def add(kind: str, message: str) -> None:
        found.append(Anomaly(kind, who, message, summary.transfer, summary.link))

    if key in report.live and report.until is None:
        add(
            "not_final",
            f"not final at the end of the trace: in {summary.state!r} for "
            f"{end - summary.since:.3f} s (age {end - summary.created:.3f} s), "
            f"last event {summary.last_event} at t={summary.last_t:.3f}",
        )
    if summary.state in spec.anomaly_states and key not in report.live:
        add(
            "anomaly_state",
            f"ended in anomaly state {summary.state!r} at t={summary.since:.3f}: "
            f"{' '.join(spec.states[summary.state].doc.split())}",
        )
    if summary.rejected:
        shown = ", ".join(
            f"{event} in {state!r} at t={t:.3f}" for t, event, state in summary.rejected[:3]
        )
        more = f" and {len(summary.rejected) - 3} more" if len(summary.rejected) > 3 else ""
        add("rejected", f"{len(summary.rejected)} event(s) rejected by the spec: {shown}{more}")
    for t, event, error in summary.raised:
        kind = "invariant violation" if error.startswith("InvariantViolation") else "binding error"
        add("raised", f"{kind} on {event} at t={t:.3f} (the step was rolled back): {error}")
    for effect, times in summary.once.items():
        if len(times) > 1:
            add(
                "twice",
                f"the once-only effect {effect} was emitted {len(times)} times (at t="
                f"{', '.join(f'{t:.3f}' for t in times)})",
            )
    return found


def _across_sides(link: str, group: list) -> list[Anomaly]:
    found = []
    senders_of: dict[str, list] = {}  # peer event -> summaries whose spec sends it once
    for s in group:
        for kind in once_only_effects(s.spec):
            if kind.startswith("send_"):
                senders_of.setdefault(kind[5:], []).append(s)
    for s in group:
        once = once_only_effects(s.spec)
        others = [o for o in group if o.side != s.side]
        for event, t in s.sends:
            if f"send_{event}" not in once:
                continue
            if not any(a[0] == event for o in others for a in o.arrivals):
                found.append(
                    Anomaly(
                        "unmatched",
                        s.who,
                        f"sent {event} at t={t:.3f} but no other "
                        f"side's trace shows it arriving (request {link!r})",
                        s.transfer,
                        link,
                    )
                )
        for event, t, source in s.arrivals:
            senders = [o for o in senders_of.get(event, ()) if o.side != s.side]
            if senders and not any(e == event for o in senders for e, _ in o.sends):
                found.append(
                    Anomaly(
                        "unmatched",
                        s.who,
                        f"received {event} at t={t:.3f}"
                        f"{f' from {source}' if source else ''} but no other side's "
                        f"trace shows it being sent (request {link!r})",
                        s.transfer,
                        link,
                    )
                )
    return found
