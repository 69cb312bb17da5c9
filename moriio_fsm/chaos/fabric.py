"""The RDMA fabric of a chaos run: a real ``LoopbackEngine`` per rank with registered KV
memory, sessions between every producer and consumer, and a real ``CompletionPoller`` per
rank turning statuses into events.

Rules: the run decides each operation's fate from its seed (succeed, fail, stall for good)
and the engine carries it out through its own fault injection (``faults.py``); a posted
operation that is not stalled is waited for until its status is final before the run
goes on, and its event is taken from the poller when the run's virtual clock says it
completes, so real threads never change what happens, only how fast. A stalled status
never becomes final; it is not handed to the poller, which would watch it until the end.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

from ..engines import CompletionPoller, LoopbackEngine
from ..engines.faults import PostedTransfer
from ..engines.loopback.descriptors import LoopbackMemoryDesc
from ..engines.loopback.engine import LoopbackSession
from ..runtime.events import Event

#: Bytes per block per layer: the run checks custody, not bandwidth.
BLOCK_BYTES = 64
BLOCKS = 64
#: How long the run waits for a loopback status or a poller event (real seconds).
WAIT_S = 30.0

_runs = itertools.count(1)


class FabricError(RuntimeError):
    """The loopback engine or poller did not answer in time (a harness problem)."""


def _uid_in(uids: set[int]) -> Callable[[PostedTransfer], bool]:
    """A fault rule's test: the posted batch's uid is in ``uids`` (read when it is posted)."""
    return lambda posted: posted.transfer_uid in uids


class Fabric:
    def __init__(self, producers: list[str], consumers: list[str], layers: int):
        run = next(_runs)
        self.layers = layers
        self.engines: dict[str, LoopbackEngine] = {}
        self.pollers: dict[str, CompletionPoller] = {}
        self._memory: dict[str, tuple[torch.Tensor, LoopbackMemoryDesc]] = {}
        self._sessions: dict[tuple[str, str], LoopbackSession] = {}
        self._failing: dict[str, set[int]] = {}
        self._stalling: dict[str, set[int]] = {}
        self._arrived = threading.Condition()
        self._inbox: dict[tuple[str, str, int, str], deque[Event]] = defaultdict(deque)
        for name in producers + consumers:
            engine = LoopbackEngine(f"chaos{run}-{name}", copy_threads=1)
            failing: set[int] = set()
            stalling: set[int] = set()
            engine.faults.fail_when(_uid_in(failing))
            engine.faults.stall_when(_uid_in(stalling))
            memory = torch.zeros(layers * BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
            self.engines[name] = engine
            self._failing[name], self._stalling[name] = failing, stalling
            self._memory[name] = (memory, engine.register_torch_tensor(memory))
            self.pollers[name] = CompletionPoller(
                functools.partial(self._deliver, name), name=f"chaos-poller-{name}"
            )
        for p in producers:
            for d in consumers:
                self._connect(p, d)
                self._connect(d, p)

    def _connect(self, local: str, remote: str) -> None:
        engine = self.engines[local]
        engine.register_remote_engine(self.engines[remote].get_engine_desc())
        session = engine.create_session(self._memory[local][1], self._memory[remote][1])
        if session is None:
            raise FabricError(f"no loopback session from {local} to {remote}")
        self._sessions[(local, remote)] = session

    def descriptors(self, name: str) -> tuple[bytes, bytes]:
        """``name``'s packed engine and memory descriptors (what a handshake carries)."""
        return self.engines[name].get_engine_desc().pack(), self._memory[name][1].pack()

    def post(
        self,
        node: str,
        peer: str,
        op: str,
        transfer_id: str,
        layer: int,
        blocks: list[int],
        fate: str,
    ) -> None:
        """Post one layer's ``op`` ("write" from node into peer, "read" from peer into
        node) for these blocks; ``fate`` is "ok", "fail" or "stall"."""
        session = self._sessions[(node, peer)]
        uid = session.allocate_transfer_uid()
        if fate == "fail":
            self._failing[node].add(uid)
        elif fate == "stall":
            self._stalling[node].add(uid)
        offsets = [((layer * BLOCKS) + block % BLOCKS) * BLOCK_BYTES for block in blocks]
        sizes = [BLOCK_BYTES] * len(offsets)
        post = session.batch_write if op == "write" else session.batch_read
        status = post(offsets, offsets, sizes, uid)
        if fate == "stall":
            return
        if not status.wait_for(int(WAIT_S * 1000)):
            raise FabricError(
                f"the loopback engine of {node} did not settle {op} of layer "
                f"{layer} of {transfer_id!r} within {WAIT_S} s"
            )
        self.pollers[node].submit(status, transfer_id, layer, op)

    def take(self, node: str, transfer_id: str, layer: int, op: str) -> Event:
        """The poller's event for that operation, once it delivered it."""
        key = (node, transfer_id, layer, op)
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._inbox[key], WAIT_S):
                raise FabricError(
                    f"the poller of {node} never delivered the {op} of layer "
                    f"{layer} of {transfer_id!r}"
                )
            event = self._inbox[key].popleft()
            if not self._inbox[key]:
                del self._inbox[key]
            return event

    def _deliver(self, node: str, event: Any) -> None:
        # A completion event (layer_write_done...): its layer is a field its spec declares.
        op = "write" if event.kind.startswith("layer_write") else "read"
        with self._arrived:
            self._inbox[(node, event.transfer_id, event.layer, op)].append(event)
            self._arrived.notify_all()

    def crash(self, node: str) -> None:
        """``node``'s process died: its engine and memory are gone (peers' operations on
        them fail), its poller stops."""
        self.pollers[node].close()
        self.engines[node].close()

    def close(self) -> None:
        for poller in self.pollers.values():
            poller.close()
        for engine in self.engines.values():
            engine.close()
