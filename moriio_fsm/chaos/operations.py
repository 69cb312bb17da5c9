"""The RDMA operations of a chaos run: each posted layer's fate, drawn from the seed, its
entry in the block ledger, and its event handed to the rank at the virtual instant it
completes.

Rules: an operation fails with the fault rate's chance and stalls for good with half of
it. A stalled one never completes: it leaves the ledger only when a teardown confirms it
or its rank crashes. One whose rank crashed before it completed delivers nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from ..ledger import Blocks, Operation
from .fabric import Fabric
from .world import World

#: An RDMA operation's completion time (virtual seconds).
COMPLETION_S = (0.001, 0.005)


class Operations:
    """The operations posted on ``fabric``, by (rank, transfer, layer)."""

    def __init__(self, world: World, fabric: Fabric):
        self.world = world
        self.fabric = fabric
        self.failed = self.stalled = 0
        self._pending: dict[tuple[str, str, int], Operation] = {}
        self._stalled: dict[tuple[str, str, int], Operation] = {}

    def post(
        self,
        rank: str,
        op: str,
        tid: str,
        layer: int,
        blocks: Sequence[int],
        peer: str,
        source: Blocks,
        target: Blocks,
    ) -> None:
        """Post one layer's ``op`` ("write" or "read") with a fate the seed decides; its
        event reaches ``rank`` when the virtual clock says it completes (never, when it
        stalled)."""
        world = self.world
        roll, rate = world.rng.random(), world.settings.fault_rate
        fate = "fail" if roll < rate else "stall" if roll < 1.5 * rate else "ok"
        entry = world.ledger.post(f"{op} of layer {layer} by {rank}/{tid}", source, target)
        self.fabric.post(rank, peer, op, tid, layer, list(blocks), fate)
        key = (rank, tid, layer)
        if fate == "stall":
            self.stalled += 1
            self._stalled[key] = entry
            return
        if fate == "fail":
            self.failed += 1
        self._pending[key] = entry

        def complete() -> None:
            if self._pending.get(key) is not entry:
                return  # its rank crashed meanwhile
            del self._pending[key]
            event = self.fabric.take(rank, tid, layer, op)
            world.ledger.settle(entry)
            world.deliver(rank, msgspec.structs.replace(event, time=world.now))

        low, high = COMPLETION_S
        world.at(low + (high - low) * world.rng.random(), complete)

    def tear_down(self, rank: str, tid: str, layers: Iterable[int]) -> None:
        """The engine confirmed: the named operations can no longer move."""
        for layer in layers:
            for table in (self._stalled, self._pending):
                entry = table.get((rank, tid, layer))
                if entry is not None:
                    self.world.ledger.settle(entry)
                    if table is self._stalled:
                        del table[(rank, tid, layer)]

    def crash(self, rank: str) -> None:
        """``rank``'s queue pairs went with its process."""
        for table in (self._pending, self._stalled):
            for key in [k for k in table if k[0] == rank]:
                self.world.ledger.settle(table.pop(key))
