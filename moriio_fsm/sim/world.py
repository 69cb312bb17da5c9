"""A deterministic in-memory P/D world: a virtual clock, a lossy channel, RDMA stand-ins.

Rules: one seeded ``random.Random`` decides every latency and fault, and the clock only
moves when the next scheduled action runs, so a seed replays the same run exactly. The
channel may lose, duplicate and delay (hence reorder) messages; the stand-in engine
completes, fails or hangs each posted operation and can be asked to tear operations
down (and may never answer). A hung operation never moves another byte. A node that dies
stops at once: its operations stop with it and messages to it are lost.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..ledger import Blocks, Ledger, Operation
from ..runtime.declared import make_event
from ..runtime.driver import Driver
from ..runtime.events import Event


@dataclass
class Faults:
    """Probabilities of each fault, per message or per operation."""

    lose: float = 0.0  # a message is lost
    duplicate: float = 0.0  # a message arrives twice
    late: float = 0.0  # a message arrives seconds late (so, reordered)
    fail_op: float = 0.0  # an RDMA operation fails
    hang_op: float = 0.0  # an RDMA operation never completes
    mute_teardown: float = 0.0  # a teardown is never confirmed
    fail_handshake: float = 0.0


@dataclass
class Op:
    """One posted RDMA operation of the stand-in engine."""

    node: str
    transfer_id: str
    layer: int
    kind: str  # "write" or "read"
    source: Blocks
    target: Blocks
    state: str = "pending"  # pending | hung | done
    entry: Operation | None = None  # its entry in the ledger, once posted


class World:
    """The clock, the scheduler, the channel and the stand-in engine."""

    def __init__(self, seed: int, faults: Faults | None = None, *, latency: float = 0.002):
        self.rng = random.Random(seed)
        self.faults = faults or Faults()
        self.latency = latency
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.ledger = Ledger()
        self.nodes: dict[str, Node] = {}
        self.log: list[str] = []
        self.ops: list[Op] = []

    # -- scheduling ---------------------------------------------------------------------

    def at(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (self.now + max(0.0, delay), next(self._seq), action))

    def run(self, until: float, tick: float = 0.25) -> None:
        """Run every scheduled action up to ``until``, firing timers every ``tick``."""
        next_tick = self.now
        while True:
            due = self._queue[0][0] if self._queue else float("inf")
            if next_tick <= due and next_tick <= until:
                self.now = next_tick
                for node in self.nodes.values():
                    node.advance()
                next_tick += tick
                continue
            if due > until:
                self.now = until
                for node in self.nodes.values():
                    node.advance()
                return
            self.now, _, action = heapq.heappop(self._queue)
            action()

    # -- the channel --------------------------------------------------------------------

    def send(self, sender: str, receiver: str, kind: str, transfer_id: str, data: dict) -> None:
        if sender in self.nodes and not self.nodes[sender].alive:
            return
        roll = self.rng.random
        if roll() < self.faults.lose:
            self.log.append(f"{self.now:9.4f} lost {kind} {sender}->{receiver} {transfer_id}")
            return
        copies = 2 if roll() < self.faults.duplicate else 1
        for _ in range(copies):
            delay = self.latency * (0.5 + roll())
            if roll() < self.faults.late:
                delay += 1.0 + 3.0 * roll()
            self.at(delay, lambda: self.deliver(sender, receiver, kind, transfer_id, data))

    def deliver(self, sender: str, receiver: str, kind: str, transfer_id: str, data: dict) -> None:
        node = self.nodes.get(receiver)
        if node is None or not node.alive:
            return
        node.dispatch(make_event(kind, transfer_id, self.now, data, source=sender))

    # -- the stand-in engine ------------------------------------------------------------

    def post(self, node: Node, op: Op, done_kind: str, failed_kind: str) -> None:
        """Post ``op``; it completes, fails or hangs later, as the faults say."""
        self.ops.append(op)
        what = f"{op.kind} of layer {op.layer} by {node.name}/{op.transfer_id}"
        entry = op.entry = self.ledger.post(what, op.source, op.target)
        roll = self.rng.random()
        if roll < self.faults.hang_op:
            op.state = "hung"  # never completes and never moves a byte again
            self._settle(op)
            return
        failed = roll < self.faults.hang_op + self.faults.fail_op

        def complete() -> None:
            if op.state != "pending":
                return  # torn down, or its node died
            self.ledger.moved(entry)
            op.state = "done"
            self._settle(op)
            kind = failed_kind if failed else done_kind
            data = {"layer": op.layer, "code": 13} if failed else {"layer": op.layer}
            node.dispatch(make_event(kind, op.transfer_id, self.now, data))

        self.at(self.latency * (1 + 4 * self.rng.random()), complete)

    def tear_down(self, node: Node, transfer_id: str, layers: tuple) -> bool:
        """Stop the operations of ``layers``; False when the engine never answers."""
        if self.rng.random() < self.faults.mute_teardown:
            return False
        for op in self.ops:
            if (
                op.node == node.name
                and op.transfer_id == transfer_id
                and op.layer in layers
                and op.state in ("pending", "hung")
            ):
                if op.state == "pending":
                    self._settle(op)
                op.state = "done"
        return True

    def kill(self, name: str) -> None:
        node = self.nodes[name]
        node.alive = False
        self.log.append(f"{self.now:9.4f} {name} died")
        for op in self.ops:
            if op.node == name and op.state == "pending":
                op.state = "done"  # its queue pair went with the process
                self._settle(op)
        self.ledger.bury(name)

    def _settle(self, op: Op) -> None:
        assert op.entry is not None, "only a posted operation settles"
        self.ledger.settle(op.entry)


class Node:
    """One P or D rank: a table and a driver per machine it runs."""

    def __init__(self, world: World, name: str):
        self.world = world
        self.name = name
        self.alive = True
        self.drivers: dict[str, Driver] = {}
        self.route: dict[str, str] = {}  # event kind -> machine that takes it
        self.effects: list[Any] = []

    def add(self, machine: str, driver: Driver) -> None:
        self.drivers[machine] = driver
        for kind in driver.table.spec.events:
            self.route.setdefault(kind, machine)

    def dispatch(self, event: Event) -> None:
        if not self.alive:
            return
        machine = self.route_for(event)
        self.world.log.append(f"{self.world.now:9.4f} {self.name} {machine}: {event!r}")
        for _, result in self.drivers[machine].dispatch(event):
            self.effects.extend(result.effects)

    def route_for(self, event: Event) -> str:
        # A kind two machines of one node share (request_finished...) goes to the one
        # that knows the transfer.
        for machine, driver in self.drivers.items():
            if (
                driver.table.state_of(event.transfer_id) is not None
                and event.kind in driver.table.spec.events
            ):
                return machine
        return self.route[event.kind]

    def advance(self) -> None:
        if not self.alive:
            return
        for machine, driver in self.drivers.items():
            for event, result in driver.advance(self.world.now):
                self.world.log.append(
                    f"{self.world.now:9.4f} {self.name} {machine}: fired {event!r}"
                )
                self.effects.extend(result.effects)

    def live(self) -> dict[str, list[str]]:
        """Transfers not ended yet, per machine."""
        return {
            machine: driver.table.live_ids()
            for machine, driver in self.drivers.items()
            if driver.table.live_ids()
        }


@dataclass
class Report:
    """What a run found: transfers per final state, and every broken promise."""

    seed: int
    ended: dict[str, dict[str, int]] = field(default_factory=dict)
    not_final: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.not_final and not self.violations
