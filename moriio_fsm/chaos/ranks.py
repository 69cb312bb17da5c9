"""One P or D rank of a chaos run: a table and a real ``Driver`` per machine it runs, and the
handlers that carry out every effect (messages through the wire, operations on the
engine, blocks to the ledger, P's answer to the proxy).

Rules: a handler does what a connector would do, nothing more; every lifecycle rule stays
in the specs. Randomness (an operation's fate, a teardown never answered) comes from the
run's seeded generator. A crashed rank takes nothing any more.
"""

from __future__ import annotations

from typing import Any

from ..adapters.zmq import (
    Heartbeat,
    LeaseGranted,
    Release,
    RemoteBlocks,
    Role,
    WriteDone,
    WriteFailed,
)
from ..ledger import BLOCK_EFFECTS, QUARANTINE
from ..machines import build_table
from ..runtime.declared import events
from ..runtime.driver import Driver
from ..runtime.events import Event
from .hosts import Hosts
from .operations import Operations
from .settings import CONFIG
from .wire import Channel
from .world import World

PRODUCER_MACHINES = {"write": "write_producer", "read": "read_producer"}
CONSUMER_MACHINES = {"write": "write_consumer", "read": "read_consumer"}


class Rank:
    """A P rank (role PRODUCER) or a D rank (role CONSUMER)."""

    def __init__(
        self,
        world: World,
        name: str,
        role: Role,
        *,
        operations: Operations,
        wire: Channel,
        hosts: Hosts,
    ):
        self.world = world
        self.name = name
        self.role = role
        self.operations = operations
        self.wire = wire
        self.hosts = hosts
        world.join(name, role, self.dispatch)
        machines = PRODUCER_MACHINES if role is Role.PRODUCER else CONSUMER_MACHINES
        self._machine_of = machines
        self.drivers: dict[str, Driver] = {}
        for machine in machines.values():
            table = build_table(world.specs.get(machine, machine), config=CONFIG[machine])
            handlers = getattr(self, f"_{machine}_handlers")()
            self.drivers[machine] = Driver(table, handlers, clock=lambda: world.now)

    @property
    def alive(self) -> bool:
        return self.world.alive(self.name)

    def dispatch(self, ev: Event) -> None:
        if not self.alive:
            return
        mode = self.world.mode_of.get(ev.transfer_id)
        if mode is None:
            return  # an id this run never started: a listener drops it
        self.drivers[self._machine_of[mode]].dispatch(ev)

    def advance(self, now: float) -> None:
        if self.alive:
            for driver in self.drivers.values():
                driver.advance(now)

    def state_of(self, transfer_id: str) -> str | None:
        mode = self.world.mode_of[transfer_id]
        return self.drivers[self._machine_of[mode]].table.state_of(transfer_id)

    def is_final(self, transfer_id: str) -> bool:
        mode = self.world.mode_of[transfer_id]
        table = self.drivers[self._machine_of[mode]].table
        return table.get(transfer_id) is None

    # -- what both sides' handlers share ----------------------------------------------------

    def _blocks(self, transfer_id: str, rank: str | None = None):
        return self.world.ledger.blocks(rank or self.name, transfer_id)

    def _ledger(self, *kinds: str) -> dict[str, Any]:
        return self.world.ledger.handlers(self.name, kinds)

    def _post(self, op: str, e, source, target) -> None:
        self.operations.post(
            self.name,
            op,
            e.transfer_id,
            e.layer,
            e.block_ids,
            self._peer(e.transfer_id),
            source,
            target,
        )

    def _tear_down(self, op: str, e) -> Event | None:
        if self.world.rng.random() < self.world.settings.fault_rate:
            return None  # the stalled engine never answers
        self.operations.tear_down(self.name, e.transfer_id, e.layers)
        kind = events.writes_abandoned if op == "write" else events.reads_abandoned
        return kind(e.transfer_id, self.world.now)

    def _peer(self, transfer_id: str) -> str:
        producer, consumer = self.world.placement[transfer_id]
        return consumer if self.role is Role.PRODUCER else producer

    def _notify(self, message) -> None:
        self.wire.notify(self.name, self._peer(message.transfer_id), message)

    # -- the four machines' handlers ---------------------------------------------------------

    def _write_producer_handlers(self) -> dict[str, Any]:
        def post_write(e) -> None:
            tid = e.transfer_id
            self._post("write", e, self._blocks(tid), self._blocks(tid, self._peer(tid)))

        return {
            "post_write": post_write,
            "abandon_writes": lambda e: self._tear_down("write", e),
            "send_write_done": lambda e: self._notify(
                WriteDone(e.transfer_id, e.num_writers, producer_rank=0)
            ),
            "send_write_failed": lambda e: self._notify(
                WriteFailed(
                    e.transfer_id, reason=e.reason, writes_stopped=e.writes_stopped, producer_rank=0
                )
            ),
            **self._ledger("free_blocks", QUARANTINE),
        }

    def _consumer_endings(self) -> dict[str, Any]:
        """What both consumers do as a transfer ends: release P, keep vLLM from freeing the
        blocks, give them back (as a load, a failed load, or freed) or quarantine them."""
        return {
            "send_release": lambda e: self._notify(Release(e.transfer_id, 1, consumer_rank=0)),
            "hold_blocks": lambda e: None,
            **self._ledger(*BLOCK_EFFECTS),
        }

    def _write_consumer_handlers(self) -> dict[str, Any]:
        return {
            "send_remote_blocks": lambda e: self._notify(
                RemoteBlocks(e.transfer_id, e.req_id, tuple(e.block_ids), decode_rank=0)
            ),
            **self._consumer_endings(),
        }

    def _read_producer_handlers(self) -> dict[str, Any]:
        return {
            "hold_for_reads": lambda e: self.hosts.start_reader(e.transfer_id),
            "send_lease_granted": lambda e: self._notify(
                LeaseGranted(e.transfer_id, e.seq, e.lease_s, consumer_rank=e.consumer_rank)
            ),
            **self._ledger("free_blocks"),
        }

    def _read_consumer_handlers(self) -> dict[str, Any]:
        def handshake(e) -> None:
            tid = e.transfer_id

            def answered(ok: bool) -> None:
                self.dispatch(
                    events.handshake_done(tid, self.world.now)
                    if ok
                    else events.handshake_failed(tid, self.world.now, "bad reply")
                )

            self.wire.handshake(self.name, self._peer(tid), answered)

        def post_read(e) -> None:
            tid = e.transfer_id
            self._post("read", e, self._blocks(tid, self._peer(tid)), self._blocks(tid))

        return {
            "request_handshake": handshake,
            "send_heartbeat": lambda e: self._notify(
                Heartbeat(e.transfer_id, e.seq, consumer_rank=0)
            ),
            "post_read": post_read,
            "abandon_reads": lambda e: self._tear_down("read", e),
            **self._consumer_endings(),
        }
