"""The search: every state a model can reach within a budget, and the two questions asked
of the whole graph (which rules broke, and from where no end can be reached alone).

Rules: breadth first, so the first path found to any state, and to any broken rule, is
a shortest one. A move costs what the model says (``Move.cost``), and the model is told how much
a state may still spend (it leaves out dearer moves); a state is explored again when it
is reached more cheaply, since the cheaper arrival can go further. A state
the model calls ended is never expanded. Liveness is decided over the moves the model
marks ``peer_free`` (timers, time, the host): a state none of whose peer-free paths ends
is stuck (a path that ends in a broken step counts as ending: that step is reported). A run that reaches ``max_states`` stops and is reported incomplete (liveness
is then not decided). The models (``single.py``, ``pair.py``) know the machines; this
file knows only states, moves and paths.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from .observer import Breach


class Move(NamedTuple):
    """One thing that can happen in a state: ``label`` says what (for counterexamples),
    ``state`` is where it leads (None when it broke a rule and leads nowhere)."""

    label: Any
    state: Any
    cost: int
    peer_free: bool
    breaches: list


class Model(Protocol):
    name: str

    def initial(self) -> Iterable[Move]: ...

    def successors(self, state, allowance: int) -> Iterable[Move]: ...

    def ended(self, state) -> bool: ...

    def end_breaches(self, state) -> list[Breach]: ...


@dataclass
class Finding:
    """A broken rule with the shortest path found to it (the labels of its moves)."""

    rule: str
    message: str
    path: list
    state: Any


@dataclass
class Exploration:
    """What a search found."""

    name: str
    states: int = 0
    transitions: int = 0
    ended: int = 0
    seconds: float = 0.0
    complete: bool = True
    stuck: int = 0
    findings: dict[str, Finding] = field(default_factory=dict)
    model: Any = None  # the model explored (for traces and contexts)

    @property
    def ok(self) -> bool:
        return self.complete and not self.findings


Progress = Callable[[str, int, int, int, float], None]


class Search:
    """One breadth-first search of ``model`` with ``budget`` for the moves' costs."""

    def __init__(
        self, model: Model, *, budget: int, max_states: int, progress: Progress | None = None
    ):
        self.model = model
        self.budget = budget
        self.max_states = max_states
        self.progress = progress
        self.ids: dict[Any, int] = {}
        self.states: list[Any] = []
        self.parent: list[int] = []
        self.via: list[Any] = []
        self.spent: list[int] = []
        self.depth: list[int] = []
        self.edges: list[list[int] | None] = []
        self.is_end: list[bool] = []
        self.is_end_by_breach: set[int] = set()
        self.result = Exploration(model.name)

    def run(self) -> Exploration:
        started = time.perf_counter()
        result = self.result
        queue: deque[int] = deque()
        expanded_at: dict[int, int] = {}
        for move in self.model.initial():
            result.transitions += 1
            self._found(move.breaches, -1, move.label, move.state)
            if move.state is not None:
                self._add(move.state, -1, move.label, move.cost, queue)
        next_report = started + 0.5
        successors, budget = self.model.successors, self.budget
        while queue:
            if len(self.states) >= self.max_states:
                result.complete = False
                break
            here = queue.popleft()
            spent = self.spent[here]
            if expanded_at.get(here, budget + 1) <= spent:
                continue  # already expanded at this cost or less
            first = here not in expanded_at
            expanded_at[here] = spent
            edges: list[int] | None = [] if first else None
            for move in successors(self.states[here], budget - spent):
                result.transitions += 1
                total = spent + move.cost
                if total > budget:  # a model that did not leave it out
                    continue
                if move.breaches:
                    self._found(move.breaches, here, move.label, move.state)
                if move.state is None:
                    if move.peer_free:
                        # A step that broke a rule is reported already; the transfer is
                        # not also stuck for want of it.
                        self.is_end_by_breach.add(here)
                    continue
                there = self.ids.get(move.state)
                if there is None:
                    there = self._add(move.state, here, move.label, total, queue)
                elif total < self.spent[there]:
                    self.spent[there] = total
                    if not self.is_end[there]:
                        queue.append(there)
                if edges is not None and move.peer_free and there != here:
                    edges.append(there)
            if first:
                self.edges[here] = edges
            if self.progress is not None and time.perf_counter() >= next_report:
                next_report = time.perf_counter() + 0.5
                self.progress(
                    self.model.name,
                    len(self.states),
                    result.transitions,
                    len(queue),
                    time.perf_counter() - started,
                )
        result.states = len(self.states)
        if result.complete:
            self._liveness()
        result.seconds = time.perf_counter() - started
        return result

    # -- bookkeeping -------------------------------------------------------------------

    def _add(self, state, parent: int, label, spent: int, queue: deque) -> int:
        index = len(self.states)
        self.ids[state] = index
        self.states.append(state)
        self.parent.append(parent)
        self.via.append(label)
        self.spent.append(spent)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
        self.edges.append(None)
        ended = self.model.ended(state)
        self.is_end.append(ended)
        if ended:
            self.result.ended += 1
            self._found(self.model.end_breaches(state), index, None, state)
        else:
            queue.append(index)
        return index

    def path_to(self, index: int) -> list:
        labels = []
        while index >= 0:
            labels.append(self.via[index])
            index = self.parent[index]
        labels.reverse()
        return labels

    def _found(self, breaches: list[Breach], at: int, label, state) -> None:
        if not breaches:
            return
        findings = self.result.findings
        length = (self.depth[at] + 1 if at >= 0 else 0) + (label is not None)
        for breach in breaches:
            known = findings.get(breach.rule)
            if known is not None and len(known.path) <= length:
                continue
            path = self.path_to(at) if at >= 0 else []
            if label is not None:
                path.append(label)
            findings[breach.rule] = Finding(breach.rule, breach.message, path, state)

    def _liveness(self) -> None:
        """Mark every state from which a peer-free path ends; report the shallowest other."""
        into: list[list[int]] = [[] for _ in self.states]
        can_end = [False] * len(self.states)
        pending: deque[int] = deque()
        for index, edges in enumerate(self.edges):
            if self.is_end[index] or index in self.is_end_by_breach:
                can_end[index] = True
                pending.append(index)
                continue
            for there in edges or ():
                into[there].append(index)
        while pending:
            for before in into[pending.popleft()]:
                if not can_end[before]:
                    can_end[before] = True
                    pending.append(before)
        stuck = [index for index, ok in enumerate(can_end) if not ok]
        self.result.stuck = len(stuck)
        if stuck:
            first = self._where_stuck(min(stuck, key=lambda index: self.depth[index]))
            describe = getattr(self.model, "describe_stuck", None)
            why = describe(self.states[first]) if describe else ""
            self.result.findings["ends_without_peer"] = Finding(
                "ends_without_peer",
                f"{len(stuck)} reachable state(s) from which no final state can be reached "
                f"with timers and local events alone{': ' + why if why else ''}",
                self.path_to(first),
                self.states[first],
            )

    def _where_stuck(self, start: int) -> int:
        """Where a stuck state ends up waiting: the state its peer-free moves lead
        farthest to (the one to show; ``start`` itself may still have moves left)."""
        distance = {start: 0}
        pending = deque([start])
        farthest = start
        while pending:
            here = pending.popleft()
            if distance[here] > distance[farthest]:
                farthest = here
            for there in self.edges[here] or ():
                if there not in distance:
                    distance[there] = distance[here] + 1
                    pending.append(there)
        return farthest


def search(
    model: Model, *, budget: int, max_states: int, progress: Progress | None = None
) -> tuple[Exploration, Search]:
    """Explore ``model``; the findings and the search (for paths and states)."""
    runner = Search(model, budget=budget, max_states=max_states, progress=progress)
    return runner.run(), runner
