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

import functools
import time
from dataclasses import dataclass, field

from ..adapters.zmq import Role
from ..ledger import FREED_UNDER_OPERATION, LEAVE_ONCE, OPERATION_ON_FREED
from .fabric import Fabric
from .hosts import Hosts
from .operations import Operations
from .ranks import Rank
from .settings import ChaosSettings
from .wire import Channel
from .world import World

#: How often every rank's timers are advanced (virtual seconds).
TICK_S = 0.05
#: After the last transfer starts, time enough for every timer chain to run out.
DRAIN_S = 60.0


@dataclass
class ChaosResult:
    """What a run found. ``double_handback`` counts breaches of the ledger's
    ``blocks_leave_once``; ``freed_in_flight`` those of ``freed_under_operation`` and
    ``operation_on_freed_blocks``; ``examples`` keeps the first of them."""

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
        return (
            f"transfers={self.transfers} completed={self.completed} failed={self.failed} "
            f"not_final={self.not_final} double_handback={self.double_handback} "
            f"freed_in_flight={self.freed_in_flight}"
        )


class ChaosRun:
    """One run of ``settings``; ``specs`` runs a machine from another spec file (machine
    name -> path), to show what a broken spec does."""

    def __init__(self, settings: ChaosSettings, specs: dict[str, str] | None = None):
        self.settings = settings
        self.world = World(settings, specs)
        producers = [f"P{i}" for i in range(settings.producers)]
        consumers = [f"D{i}" for i in range(settings.consumers)]
        self.fabric = Fabric(producers, consumers, settings.layers)
        self.operations = Operations(self.world, self.fabric)
        self.wire = Channel(self.world, self.fabric)
        self.hosts = Hosts(self.world)
        self._ranks = {name: self._rank(name, Role.PRODUCER) for name in producers}
        self._ranks.update({name: self._rank(name, Role.CONSUMER) for name in consumers})
        self.crashed = ""

    def _rank(self, name: str, role: Role) -> Rank:
        return Rank(
            self.world, name, role, operations=self.operations, wire=self.wire, hosts=self.hosts
        )

    def run(self) -> ChaosResult:
        started = time.perf_counter()
        settings, world = self.settings, self.world
        last_start = 0.0
        for index in range(settings.transfers):
            last_start += world.rng.expovariate(1.0 / settings.spacing_s)
            start = self.hosts.start_write if index % 2 == 0 else self.hosts.start_read
            world.at_time(last_start, functools.partial(start, f"tx-{index}"))
        if settings.fault_rate > 0:
            victim = world.rng.choice(sorted(self._ranks))
            world.at_time(world.rng.random() * last_start, lambda: self._crash(victim))
        try:
            world.run_until(last_start + DRAIN_S, TICK_S, self._advance)
            return self._result(time.perf_counter() - started)
        finally:
            self.fabric.close()

    def _advance(self, now: float) -> None:
        for rank in self._ranks.values():
            rank.advance(now)

    def _crash(self, name: str) -> None:
        self.crashed = name
        self.world.crash(name)
        self.fabric.crash(name)
        self.operations.crash(name)

    # -- the verdict ---------------------------------------------------------------------------

    def _result(self, seconds: float) -> ChaosResult:
        completed = failed = not_final = 0
        stuck: list[str] = []
        for tid, (p, d) in self.world.placement.items():
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
        unplaced = self.settings.transfers - len(self.world.placement)
        wire, ledger = self.wire, self.world.ledger
        faults = {
            "rdma_failed": self.operations.failed,
            "rdma_stalled": self.operations.stalled,
            "aborted": self.hosts.aborted,
            "messages_lost": wire.lost,
            "messages_duplicated": wire.duplicated,
            "messages_delayed": wire.delayed,
            "undecodable": wire.undecodable,
        }
        misused = ledger.counts[FREED_UNDER_OPERATION] + ledger.counts[OPERATION_ON_FREED]
        return ChaosResult(
            self.settings.transfers,
            completed,
            failed + unplaced,
            not_final,
            ledger.counts[LEAVE_ONCE],
            misused,
            seconds=seconds,
            crashed=self.crashed,
            faults=faults,
            examples=[str(violation) for violation in ledger.violations],
            stuck=stuck,
        )


def run_chaos(settings: ChaosSettings, specs: dict[str, str] | None = None) -> ChaosResult:
    """Run ``settings`` (with machines from ``specs`` files, if given) and return what
    happened."""
    return ChaosRun(settings, specs).run()
