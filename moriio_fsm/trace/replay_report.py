"""What a replay reports: the first divergence of each transfer, a summary of every
transfer (what the anomaly analysis and ``explain`` read), and the report itself.

Rules: a summary keeps what the analysis needs of a transfer, never its whole history
(unless the replay collects steps for ``explain``), so memory grows with the live
transfers of a trace, not with its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .format import RAISED, Gap, ReplayStep
from .reader import printable


@dataclass
class Divergence:
    """The first step of one transfer whose replay differs from the record."""

    path: str
    line: int
    step: ReplayStep
    what: str
    recorded: Any
    replayed: Any
    context: list[str] = field(default_factory=list)

    def describe(self) -> str:
        s = self.step
        return (
            f"{self.path}:{self.line}: side {s.side}, table {s.table}, seq {s.seq}, transfer "
            f"{s.transfer!r}, event {s.event} at t={s.t:.6f}: recorded {self.what} "
            f"{self.recorded!r}, the replay gives {self.replayed!r}"
        )


class TransferSummary:
    """What the analysis needs of one transfer of one side, kept while replaying."""

    __slots__ = (
        "side",
        "table",
        "spec",
        "transfer",
        "link",
        "created",
        "since",
        "since_wall",
        "created_wall",
        "last",
        "last_t",
        "last_event",
        "state",
        "rejected",
        "once",
        "sends",
        "arrivals",
        "raised",
        "partial",
        "steps",
        "lines",
    )

    def __init__(self, side: str, table: str, spec, transfer: str, link: str, t: float):
        self.side, self.table, self.spec, self.transfer, self.link = (
            side,
            table,
            spec,
            transfer,
            link,
        )
        self.created = self.since = self.last_t = t
        self.created_wall = self.since_wall = t
        self.last: ReplayStep | None = None  # the transfer's latest step
        self.last_event = ""
        self.state: str | None = None
        self.rejected: list[tuple[float, str, str | None]] = []
        self.once: dict[str, list[float]] = {}
        self.sends: list[tuple[str, float]] = []  # (event the peer gets, t)
        self.arrivals: list[tuple[str, float, str]] = []  # (event, t, source)
        self.raised: list[tuple[float, str, str]] = []  # (t, event, error)
        self.partial = False
        self.steps: list[ReplayStep] | None = None  # collected (explain)
        self.lines: list[tuple[str, int]] | None = None

    @property
    def who(self) -> str:
        return f"{printable(self.side)}/{printable(self.table)} {self.transfer!r}"

    def note(
        self, step: ReplayStep, remote: frozenset, once: dict, messages: dict, noted: frozenset
    ) -> None:
        """Take ``step`` into the summary: its state, refusals, errors, the peer's
        arrivals and the effects the analysis counts (``once``: once-only kinds;
        ``messages``: effect kind -> the event the peer gets; ``noted``: both)."""
        self.last = step
        after = step.after
        if after != self.state:
            self.since = step.t
            self.since_wall = step.t if step.wall is None else step.wall
            self.state = after
        outcome = step.outcome
        if outcome == "rejected":
            self.rejected.append((step.t, step.event, step.before))
        elif outcome == RAISED:
            self.raised.append((step.t, step.event, step.error or ""))
        if step.event in remote:
            self.arrivals.append((step.event, step.t, step.source))
        effects = step.effects
        if effects and (len(effects) > 1 or effects[0].get("kind") in noted):
            # One row may emit several effects of a kind (one per layer): the once-only
            # rule and the messages count the steps that emitted a kind, not its instances.
            for kind in dict.fromkeys(effect.get("kind") for effect in effects):
                if kind is None:  # a kind-less effect is no kind it counts
                    continue
                if kind in once and step.event not in once[kind]:
                    self.once.setdefault(kind, []).append(step.t)
                peer_event = messages.get(kind)
                if peer_event is not None:
                    self.sends.append((peer_event, step.t))


@dataclass
class ReplayReport:
    """Everything one replay found; ``ok`` when nothing diverged and nothing is anomalous."""

    files: list[str]
    executor: str
    steps: int = 0
    compared: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    transfers: dict[tuple[str, str, str], TransferSummary] = field(default_factory=dict)
    live: dict[tuple[str, str, str], Any] = field(default_factory=dict)  # final records
    anomalies: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gaps: list[Gap] = field(default_factory=list)
    sides: list[str] = field(default_factory=list)
    until: int | None = None
    #: The latest wall clock (or ``t`` where a step has none) of any step: where the
    #: traces end, comparable across sides.
    end_wall: float = float("-inf")

    @property
    def ok(self) -> bool:
        return not self.divergences and not self.anomalies

    @property
    def first_divergence(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None
