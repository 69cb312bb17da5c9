"""The hosts of a chaos run: vLLM on each rank and the proxy, starting each transfer the way
they would (WRITE: D allocates, P computes layer by layer, seals, finishes; READ: P
prefills and holds, the proxy starts D, D reads), some requests aborted.

Rules: each transfer goes to one live P rank and one live D rank the seed picks; one
started while no rank of a side is alive is never placed. Each request is aborted with
the fault rate's chance at each chance it has.
"""

from __future__ import annotations

import functools

from ..adapters.zmq import Role
from ..runtime.declared import events
from .fabric import BLOCKS
from .world import World


class Hosts:
    def __init__(self, world: World):
        self.world = world
        self.aborted = 0

    def start_write(self, tid: str) -> None:
        placed = self._place(tid, "write")
        if placed is None:
            return
        p, d = placed
        world, layers = self.world, self.world.settings.layers
        rng, send = world.rng, world.deliver
        send(d, events.receive_started(tid, world.now, 1))
        world.at(
            0.005 * rng.random(),
            lambda: send(
                d, events.blocks_allocated(tid, world.now, self._blocks_of(tid), f"req-d-{tid}")
            ),
        )
        if self._abort():
            world.at(0.02 * rng.random(), lambda: send(d, events.request_finished(tid, world.now)))
        send(p, events.prefill_started(tid, world.now, 1))

        def schedule(layer: int) -> None:
            send(p, events.layer_scheduled(tid, world.now, layer))

        for layer in range(layers):
            world.at(0.002 * (layer + 1), functools.partial(schedule, layer))
        world.at(0.002 * (layers + 1), lambda: send(p, events.seal(tid, world.now)))
        end = events.abort if self._abort() else events.request_finished
        world.at(0.002 * (layers + 2), lambda: send(p, end(tid, world.now)))

    def start_read(self, tid: str) -> None:
        placed = self._place(tid, "read")
        if placed is None:
            return
        p, d = placed
        world, send = self.world, self.world.deliver
        send(p, events.serve_started(tid, world.now, 1))
        end = events.abort if self._abort() else events.request_finished
        world.at(0.01, lambda: send(p, end(tid, world.now)))
        if self._abort():
            world.at(
                0.05 + 0.2 * world.rng.random(),
                lambda: send(d, events.request_finished(tid, world.now)),
            )

    def start_reader(self, tid: str) -> None:
        """P held its blocks and answered: the proxy gives D P's read parameters."""
        world, send = self.world, self.world.deliver
        d = world.placement[tid][1]
        rng, layers = world.rng, world.settings.layers
        world.at(
            0.01 + 0.02 * rng.random(),
            lambda: send(d, events.read_started(tid, world.now, layers, self._blocks_of(tid))),
        )
        world.at(0.05 + 0.05 * rng.random(), lambda: send(d, events.start_reads(tid, world.now)))

    def _place(self, tid: str, mode: str) -> tuple[str, str] | None:
        world = self.world
        producers, consumers = world.live(Role.PRODUCER), world.live(Role.CONSUMER)
        if not producers or not consumers:
            return None
        p, d = world.rng.choice(producers), world.rng.choice(consumers)
        world.mode_of[tid] = mode
        world.placement[tid] = (p, d)
        return p, d

    @staticmethod
    def _blocks_of(tid: str) -> list[int]:
        return [int(tid[3:]) % BLOCKS]

    def _abort(self) -> bool:
        if self.world.rng.random() < self.world.settings.fault_rate:
            self.aborted += 1
            return True
        return False
