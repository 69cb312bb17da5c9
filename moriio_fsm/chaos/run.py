"""A chaos run: many transfers of both modes through the real machines, drivers, wire codec,
loopback engines and pollers, under every fault at once, judged by the block ledger.

Theory of operation: one virtual clock and one queue of scheduled actions, run in time
order; every timer is advanced on a fixed tick. Each transfer is placed on one P rank
and one D rank; the hosts' events come as vLLM would send them (WRITE: D allocates, P
computes layer by layer, seals, finishes; READ: P prefills and holds, the proxy starts D,
D reads). One seeded ``random.Random`` decides every latency and fault, so a seed
replays the same run. At the end every transfer of a live rank must be final; the
result counts the transfers completed (D received the KV), failed, not final, and the
ledger's breaches.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from ..adapters.zmq.codec import Role
from ..runtime.declared import events
from .fabric import BLOCKS, Fabric
from .ledger import Ledger, Operation
from .ranks import Rank
from .settings import ChaosSettings
from .wire import Channel

#: How often every rank's timers are advanced (virtual seconds).
TICK_S = 0.05
#: After the last transfer starts, time enough for every timer chain to run out.
DRAIN_S = 60.0
#: An RDMA operation's completion time (virtual seconds).
COMPLETION_S = (0.001, 0.005)


@dataclass
class ChaosResult:
    transfers: int
    completed: int
    failed: int
    not_final: int
    double_handback: int
    freed_in_flight: int
    seconds: float = 0.0
    crashed: str = ""
    faults: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.not_final or self.double_handback or self.freed_in_flight)

    def line(self) -> str:
        """The run's verdict, exactly as the command prints it last."""
        return (f"transfers={self.transfers} completed={self.completed} failed={self.failed} "
                f"not_final={self.not_final} double_handback={self.double_handback} "
                f"freed_in_flight={self.freed_in_flight}")


class ChaosRun:
    """One run of ``settings``; ``specs`` runs a machine from another spec file (machine
    name -> path), to show what a broken spec does."""

    def __init__(self, settings: ChaosSettings, specs: dict[str, str] | None = None):
        self.settings = settings
        self.specs = dict(specs or {})
        self.rng = random.Random(settings.seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self.ledger = Ledger()
        producers = [f"P{i}" for i in range(settings.producers)]
        consumers = [f"D{i}" for i in range(settings.consumers)]
        self.fabric = Fabric(producers, consumers, settings.layers)
        self.wire = Channel(self, self.rng, settings.fault_rate)
        self._ranks = {name: Rank(self, name, Role.PRODUCER) for name in producers}
        self._ranks.update({name: Rank(self, name, Role.CONSUMER) for name in consumers})
        self.mode_of: dict[str, str] = {}
        self.placement: dict[str, tuple[str, str]] = {}
        self._ops: dict[tuple[str, str, int], Operation] = {}
        self._stalled: dict[tuple[str, str, int], Operation] = {}
        self.faults = {"rdma_failed": 0, "rdma_stalled": 0, "aborted": 0}
        self.crashed = ""

    # -- the clock ---------------------------------------------------------------------------

    def at(self, delay: float, action: Callable[[], object]) -> None:
        heapq.heappush(self._queue, (self.now + max(0.0, delay), next(self._seq), action))

    def run(self) -> ChaosResult:
        started = time.perf_counter()
        settings, rng = self.settings, self.rng
        last_start = 0.0
        for index in range(settings.transfers):
            last_start += rng.expovariate(1.0 / settings.spacing_s)
            start = self._start_write if index % 2 == 0 else self._start_read
            heapq.heappush(self._queue, (last_start, next(self._seq),
                                         lambda start=start, index=index: start(f"tx-{index}")))
        if settings.fault_rate > 0:
            victim = rng.choice(sorted(self._ranks))
            heapq.heappush(self._queue, (rng.random() * last_start, next(self._seq),
                                         lambda: self._crash(victim)))
        try:
            self._run_until(last_start + DRAIN_S)
            return self._result(time.perf_counter() - started)
        finally:
            self.fabric.close()

    def _run_until(self, until: float) -> None:
        next_tick = 0.0
        queue = self._queue
        while True:
            due = queue[0][0] if queue else until
            if next_tick <= due and next_tick <= until:
                self.now = next_tick
                for rank in self._ranks.values():
                    rank.advance(next_tick)
                next_tick += TICK_S
                continue
            if due > until or not queue:
                self.now = until
                for rank in self._ranks.values():
                    rank.advance(until)
                return
            self.now, _, action = heapq.heappop(queue)
            action()

    # -- ranks -------------------------------------------------------------------------------

    def rank(self, name: str) -> Rank:
        return self._ranks[name]

    def alive(self, name: str) -> bool:
        return self._ranks[name].alive

    def role_of(self, name: str) -> Role:
        return self._ranks[name].role

    def _live(self, role: Role) -> list[str]:
        return [name for name, rank in sorted(self._ranks.items())
                if rank.role is role and rank.alive]

    def _crash(self, name: str) -> None:
        self.crashed = name
        self._ranks[name].alive = False
        self.fabric.crash(name)
        self.ledger.bury(name)
        for key in [k for k in self._ops if k[0] == name]:      # its queue pairs went with it
            self.ledger.settle(self._ops.pop(key))
        for key in [k for k in self._stalled if k[0] == name]:
            self.ledger.settle(self._stalled.pop(key))

    # -- the hosts -----------------------------------------------------------------------------

    def _place(self, tid: str, mode: str) -> tuple[Rank, Rank] | None:
        producers, consumers = self._live(Role.PRODUCER), self._live(Role.CONSUMER)
        if not producers or not consumers:
            return None
        p, d = self.rng.choice(producers), self.rng.choice(consumers)
        self.mode_of[tid] = mode
        self.placement[tid] = (p, d)
        return self._ranks[p], self._ranks[d]

    def _blocks_of(self, tid: str) -> list[int]:
        return [int(tid[3:]) % BLOCKS]

    def _abort(self) -> bool:
        if self.rng.random() < self.settings.fault_rate:
            self.faults["aborted"] += 1
            return True
        return False

    def _start_write(self, tid: str) -> None:
        placed = self._place(tid, "write")
        if placed is None:
            return
        p, d = placed
        rng, layers = self.rng, self.settings.layers
        d.dispatch(events.receive_started(tid, self.now, 1))
        self.at(0.005 * rng.random(),
                lambda: d.dispatch(events.blocks_allocated(tid, self.now, self._blocks_of(tid),
                                                           f"req-d-{tid}")))
        if self._abort():
            self.at(0.02 * rng.random(), lambda: d.dispatch(events.request_finished(tid, self.now)))
        p.dispatch(events.prefill_started(tid, self.now, 1))
        for layer in range(layers):
            self.at(0.002 * (layer + 1),
                    lambda layer=layer: p.dispatch(events.layer_scheduled(tid, self.now, layer)))
        self.at(0.002 * (layers + 1), lambda: p.dispatch(events.seal(tid, self.now)))
        end = events.abort if self._abort() else events.request_finished
        self.at(0.002 * (layers + 2), lambda: p.dispatch(end(tid, self.now)))

    def _start_read(self, tid: str) -> None:
        placed = self._place(tid, "read")
        if placed is None:
            return
        p, d = placed
        p.dispatch(events.serve_started(tid, self.now, 1))
        end = events.abort if self._abort() else events.request_finished
        self.at(0.01, lambda: p.dispatch(end(tid, self.now)))
        if self._abort():
            self.at(0.05 + 0.2 * self.rng.random(),
                    lambda: d.dispatch(events.request_finished(tid, self.now)))

    def start_reader(self, tid: str) -> None:
        """P held its blocks and answered: the proxy gives D P's read parameters."""
        d = self._ranks[self.placement[tid][1]]
        rng, layers = self.rng, self.settings.layers
        self.at(0.01 + 0.02 * rng.random(), lambda: d.dispatch(
            events.read_started(tid, self.now, layers, self._blocks_of(tid))))
        self.at(0.05 + 0.05 * rng.random(), lambda: d.dispatch(events.start_reads(tid, self.now)))

    # -- the engine ----------------------------------------------------------------------------

    def post(self, rank: Rank, op: str, tid: str, layer: int, blocks, peer: str,
             source, target) -> None:
        """Post one layer's operation with a fate the seed decides; its event arrives
        when the virtual clock says it completes (never, when it stalled)."""
        roll, rate = self.rng.random(), self.settings.fault_rate
        fate = "fail" if roll < rate else "stall" if roll < 1.5 * rate else "ok"
        what = f"{op} of layer {layer} by {rank.name}/{tid}"
        entry = self.ledger.post(what, source, target)
        self.fabric.post(rank.name, peer, op, tid, layer, list(blocks), fate)
        key = (rank.name, tid, layer)
        if fate == "stall":
            self.faults["rdma_stalled"] += 1
            self._stalled[key] = entry
            return
        if fate == "fail":
            self.faults["rdma_failed"] += 1
        self._ops[key] = entry

        def complete() -> None:
            if self._ops.get(key) is not entry:
                return                       # its rank crashed meanwhile
            del self._ops[key]
            event = self.fabric.take(rank.name, tid, layer, op)
            self.ledger.settle(entry)
            rank.dispatch(msgspec.structs.replace(event, time=self.now))

        low, high = COMPLETION_S
        self.at(low + (high - low) * self.rng.random(), complete)

    def tear_down(self, rank: Rank, tid: str, layers) -> None:
        """The engine confirmed: the named operations can no longer move."""
        for layer in layers:
            for table in (self._stalled, self._ops):
                entry = table.get((rank.name, tid, layer))
                if entry is not None:
                    self.ledger.settle(entry)
                    if table is self._stalled:
                        del table[(rank.name, tid, layer)]

    # -- the verdict ---------------------------------------------------------------------------

    def _result(self, seconds: float) -> ChaosResult:
        completed = failed = not_final = 0
        stuck: list[str] = []
        for tid, (p, d) in self.placement.items():
            sides = [self._ranks[p], self._ranks[d]]
            live = [rank for rank in sides if rank.alive and not rank.is_final(tid)]
            if live:
                not_final += 1
                if len(stuck) < 20:
                    stuck.extend(f"{rank.name}/{tid} in {rank.state_of(tid)!r}" for rank in live)
            elif self._ranks[d].state_of(tid) == "received":
                completed += 1
            else:
                failed += 1
        unplaced = self.settings.transfers - len(self.placement)
        faults = dict(self.faults, messages_lost=self.wire.lost,
                      messages_duplicated=self.wire.duplicated,
                      messages_delayed=self.wire.delayed, undecodable=self.wire.undecodable)
        return ChaosResult(self.settings.transfers, completed, failed + unplaced, not_final,
                           self.ledger.double_handbacks, self.ledger.freed_in_flight,
                           seconds=seconds, crashed=self.crashed, faults=faults,
                           examples=list(self.ledger.examples), stuck=stuck)


def run_chaos(settings: ChaosSettings, specs: dict[str, str] | None = None) -> ChaosResult:
    """Run ``settings`` (with machines from ``specs`` files, if given) and return what
    happened."""
    return ChaosRun(settings, specs).run()
