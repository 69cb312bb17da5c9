"""Joint P/D runs: producer and consumer machines of both modes, each node with its driver,
wired through the in-memory world, under heterogeneous TP and injected faults.

Rules: every P and D rank runs the real tables and drivers of the shipped specs; the
handlers here only move messages, post stand-in RDMA operations and tell the ledger
where blocks go. A run is fully determined by its seed. At the end every transfer of a
live node must be final and the ledger must hold no violation; the report lists what
broke and the run's log, so a failing seed can be read and replayed.

Transfer ids: in WRITE mode a P rank keeps one transfer per D rank it writes to
(``<id>>d<rank>``), each D rank one (``<id>``); in READ mode each P rank keeps one
(``<id>``) and each D rank one per P rank it reads from (``<id><p<rank>``); ``link``
maps each of them to ``<id>``, the request both sides share (for traces).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..ledger import BLOCK_EFFECTS, QUARANTINE
from ..machines import build_table
from ..runtime.declared import events
from ..runtime.driver import Driver
from ..runtime.events import Event
from .world import Faults, Node, Op, Report, World

#: Timeouts scaled down so a run spans seconds of virtual time; the orders of magnitude
#: (P's drain below D's safety timeout, the read budget below the lease) are kept.
CONFIG = {
    "write_producer": {"defer_timeout_s": 6.0, "transfer_timeout_s": 3.0, "abandon_timeout_s": 1.0},
    "write_consumer": {"write_timeout_s": 12.0, "safety_timeout_s": 6.0},
    "read_producer": {"lease_s": 3.0, "max_hold_s": 30.0},
    "read_consumer": {
        "setup_timeout_s": 3.0,
        "read_timeout_s": 1.0,
        "renew_interval_s": 0.5,
        "lease_margin_s": 0.6,
        "abandon_timeout_s": 0.3,
    },
}
LAYERS = 4


def link(transfer_id: str) -> str:
    """The request a sim transfer id belongs to (its id without the rank suffix)."""
    return transfer_id.split(">d")[0].split("<p")[0]


@dataclass(frozen=True)
class Layout:
    """How many P and D ranks one transfer spans (TP sizes may differ)."""

    p: int
    d: int

    def writers_of(self, d: int) -> list[int]:
        """P ranks that write into (or are read by) D rank ``d``."""
        if self.p >= self.d:
            share = self.p // self.d
            return list(range(d * share, (d + 1) * share))
        return [d * self.p // self.d]

    def readers_of(self, p: int) -> list[int]:
        return [d for d in range(self.d) if p in self.writers_of(d)]


class PD:
    """A world of P ranks and D ranks running transfers of both modes."""

    def __init__(
        self,
        seed: int,
        layout: Layout,
        faults: Faults | None = None,
        specs: dict[str, str] | None = None,
        recorders: Callable[[str], Any] | None = None,
    ):
        self.world = World(seed, faults)
        self.specs = specs or {}
        # recorders(node name) -> the recorder of that node's tables (a TraceRecorder), or None
        self.recorders = recorders
        self.layout = layout
        self.rng = self.world.rng
        for p in range(layout.p):
            self._node(f"P{p}", ("write_producer", "read_producer"))
        for d in range(layout.d):
            self._node(f"D{d}", ("write_consumer", "read_consumer"))
        self.started = 0

    # -- wiring --------------------------------------------------------------------------

    def _node(self, name: str, machines: tuple[str, ...]) -> None:
        node = Node(self.world, name)
        self.world.nodes[name] = node
        recorder = self.recorders(name) if self.recorders is not None else None
        for machine in machines:
            table = build_table(
                self.specs.get(machine, machine),
                config=CONFIG[machine],
                check_invariants=machine not in self.specs,
                recorder=recorder,
            )
            handlers = getattr(self, f"_{machine}_handlers")(node)
            node.add(machine, Driver(table, handlers, clock=lambda: self.world.now))

    def _blocks(self, node: str, transfer_id: str):
        return self.world.ledger.blocks(node, transfer_id)

    def _operations(self, node: Node, op: str, blocks: Callable[[Any], tuple]) -> dict:
        """The handlers that post and abandon ``node``'s operations (``op`` is "write" or
        "read"); ``blocks(effect)`` names an operation's source and target blocks."""
        w = self.world
        abandoned = events.writes_abandoned if op == "write" else events.reads_abandoned

        def post(e):
            source, target = blocks(e)
            w.post(
                node,
                Op(node.name, e.transfer_id, e.layer, op, source, target),
                f"layer_{op}_completed",
                f"layer_{op}_failed",
            )

        def abandon(e):
            if w.tear_down(node, e.transfer_id, e.layers):
                return abandoned(e.transfer_id, w.now)
            return None

        return {f"post_{op}": post, f"abandon_{op}s": abandon}

    def _write_producer_handlers(self, node: Node) -> dict:
        w, p = self.world, int(node.name[1:])

        def blocks(e):  # the source here, the target on the D rank written to
            base = e.transfer_id.split(">")[0]
            return self._blocks(node.name, e.transfer_id), self._blocks(f"D{e.decode_rank}", base)

        def verdict(kind, e, data):
            base = e.transfer_id.split(">")[0]
            ranks = [e.decode_rank] if e.decode_rank >= 0 else [int(e.transfer_id.split(">d")[1])]
            for d in ranks:
                w.send(node.name, f"D{d}", kind, base, {**data, "producer_rank": p})

        return {
            **self._operations(node, "write", blocks),
            "send_write_done": lambda e: verdict("write_done", e, {"num_writers": e.num_writers}),
            "send_write_failed": lambda e: verdict(
                "write_failed", e, {"reason": e.reason, "writes_stopped": e.writes_stopped}
            ),
            **w.ledger.handlers(node.name, ("free_blocks", QUARANTINE)),
        }

    def _write_consumer_handlers(self, node: Node) -> dict:
        w, d = self.world, int(node.name[1:])
        writers = self.layout.writers_of(d)

        def to_writers(kind, e, data):
            for p in writers:
                w.send(node.name, f"P{p}", kind, f"{e.transfer_id}>d{d}", data)

        return {
            "send_remote_blocks": lambda e: to_writers(
                "remote_blocks", e, {"block_ids": e.block_ids, "decode_rank": d, "req_id": e.req_id}
            ),
            "send_release": lambda e: to_writers(
                "release", e, {"consumer_tp_size": 1, "consumer_rank": d}
            ),
            "hold_blocks": lambda e: None,
            **w.ledger.handlers(node.name, BLOCK_EFFECTS),
        }

    def _read_producer_handlers(self, node: Node) -> dict:
        w, p = self.world, int(node.name[1:])

        def hold(e):
            # P's response reaches the proxy, which starts each D rank's reads.
            for d in self.layout.readers_of(p):
                tid = f"{e.transfer_id}<p{p}"
                w.at(
                    0.01 + 0.02 * self.rng.random(),
                    lambda d=d, tid=tid: w.nodes[f"D{d}"].dispatch(
                        events.read_started(tid, w.now, LAYERS, [p, 7])
                    ),
                )
                w.at(
                    0.05 + 0.05 * self.rng.random(),
                    lambda d=d, tid=tid: w.nodes[f"D{d}"].dispatch(events.start_reads(tid, w.now)),
                )

        return {
            "hold_for_reads": hold,
            "send_lease_granted": lambda e: w.send(
                node.name,
                f"D{e.consumer_rank}",
                "lease_granted",
                f"{e.transfer_id}<p{p}",
                {"seq": e.seq, "lease_s": e.lease_s, "consumer_rank": e.consumer_rank},
            ),
            **w.ledger.handlers(node.name, ("free_blocks",)),
        }

    def _read_consumer_handlers(self, node: Node) -> dict:
        w, d = self.world, int(node.name[1:])

        def producer(e):
            base, rank = e.transfer_id.split("<p")
            return base, int(rank)

        def handshake(e):
            kind = (
                "handshake_failed"
                if self.rng.random() < w.faults.fail_handshake
                else "handshake_done"
            )
            data = {"error": "refused"} if kind == "handshake_failed" else {}
            w.at(
                w.latency * 2,
                lambda: node.dispatch(
                    events.handshake_failed(e.transfer_id, w.now, "refused")
                    if data
                    else events.handshake_done(e.transfer_id, w.now)
                ),
            )

        def blocks(e):  # the source on the P rank read from, the target here
            base, p = producer(e)
            return self._blocks(f"P{p}", base), self._blocks(node.name, e.transfer_id)

        def to_producer(kind, e, data):
            base, p = producer(e)
            w.send(node.name, f"P{p}", kind, base, data)

        return {
            "request_handshake": handshake,
            "send_heartbeat": lambda e: to_producer(
                "heartbeat", e, {"consumer_rank": d, "seq": e.seq}
            ),
            **self._operations(node, "read", blocks),
            "send_release": lambda e: to_producer(
                "release",
                e,
                {
                    "consumer_tp_size": len(self.layout.readers_of(producer(e)[1])),
                    "consumer_rank": d,
                },
            ),
            "hold_blocks": lambda e: None,
            **w.ledger.handlers(node.name, BLOCK_EFFECTS),
        }

    # -- what the hosts do -----------------------------------------------------------------

    def start_write(self, tid: str, *, abort_p: bool = False, abort_d: bool = False) -> None:
        """One WRITE transfer: P's forward pass layer by layer, D's allocation, the ends."""
        w, layout = self.world, self.layout
        self.started += 1
        for d in range(layout.d):
            node = w.nodes[f"D{d}"]
            node.dispatch(events.receive_started(tid, w.now, len(layout.writers_of(d))))
            self._later(0.005 * self.rng.random(), node, [tid], events.blocks_allocated, [1, 2, 3])
            if abort_d:
                self._later(0.02 * self.rng.random(), node, [tid], events.request_finished)
        for p in range(layout.p):
            node = w.nodes[f"P{p}"]
            targets = [f"{tid}>d{d}" for d in layout.readers_of(p)]
            for target in targets:
                node.dispatch(
                    events.prefill_started(
                        target, w.now, len(layout.writers_of(int(target.split(">d")[1])))
                    )
                )
            for layer in range(LAYERS):
                self._later(0.002 * (layer + 1), node, targets, events.layer_scheduled, layer)
            self._later(0.002 * (LAYERS + 1), node, targets, events.seal)
            end = events.abort if abort_p else events.request_finished
            self._later(0.002 * (LAYERS + 2), node, targets, end)

    def start_read(self, tid: str, *, abort_p: bool = False, abort_d: bool = False) -> None:
        """One READ transfer: P's prefill, then the proxy starts D's reads (see handlers)."""
        w, layout = self.world, self.layout
        self.started += 1
        for p in range(layout.p):
            node = w.nodes[f"P{p}"]
            node.dispatch(events.serve_started(tid, w.now, len(layout.readers_of(p))))
            end = events.abort if abort_p else events.request_finished
            self._later(0.01, node, [tid], end)
        if abort_d:
            for d in range(layout.d):
                for p in layout.writers_of(d):
                    self._later(
                        0.05 + 0.2 * self.rng.random(),
                        w.nodes[f"D{d}"],
                        [f"{tid}<p{p}"],
                        events.request_finished,
                    )

    def _later(
        self,
        delay: float,
        node: Node,
        transfers: list[str],
        make: Callable[..., Event],
        *payload: Any,
    ) -> None:
        """In ``delay`` seconds, ``node`` takes ``make(transfer, now, *payload)`` for each of
        ``transfers`` (bound now: a caller's loop variables cannot change them later)."""
        world = self.world

        def dispatch() -> None:
            for transfer in transfers:
                node.dispatch(make(transfer, world.now, *payload))

        world.at(delay, dispatch)

    def report(self) -> Report:
        report = Report(seed=0)
        for name, node in self.world.nodes.items():
            if not node.alive:
                continue
            for machine, ids in node.live().items():
                report.not_final.extend(f"{name}/{machine}/{tid}" for tid in ids)
            for machine, driver in node.drivers.items():
                for state, count in driver.table.stats()["ended"].items():
                    bucket = report.ended.setdefault(machine, {})
                    bucket[state] = bucket.get(state, 0) + count
        report.violations = [str(violation) for violation in self.world.ledger.violations]
        report.log = self.world.log
        return report


def run(
    seed: int,
    layout: Layout,
    faults: Faults | None = None,
    *,
    transfers: int = 20,
    deaths: int = 0,
    abort_rate: float = 0.1,
    specs: dict[str, str] | None = None,
    recorders: Callable[[str], Any] | None = None,
) -> Report:
    """Start ``transfers`` WRITE and READ transfers at random times (some aborted on one
    side), kill ``deaths`` random nodes at random times, run until every timer could
    have fired, and report. ``specs`` replaces shipped specs by other files (machine name
    -> path), to show what a broken spec does; ``recorders`` traces each node (see PD)."""
    pd = PD(seed, layout, faults, specs, recorders)
    rng, w = pd.rng, pd.world
    for i in range(transfers):
        mode = pd.start_write if i % 2 == 0 else pd.start_read
        when = rng.random() * 2.0
        abort_p, abort_d = rng.random() < abort_rate, rng.random() < abort_rate
        w.at(when, functools.partial(mode, f"tx-{i}", abort_p=abort_p, abort_d=abort_d))
    names = sorted(w.nodes)
    for _ in range(deaths):
        victim = rng.choice(names)
        w.at(rng.random() * 2.5, functools.partial(_kill_if_alive, w, victim))
    w.run(until=80.0, tick=0.05)
    report = pd.report()
    report.seed = seed
    return report


def _kill_if_alive(world: World, name: str) -> None:
    if world.nodes[name].alive:
        world.kill(name)
