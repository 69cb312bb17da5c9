"""One WRITE-mode transfer end to end on one host: every part real but the RDMA wire.

P and D each own a ZeroMQ transport on 127.0.0.1 and a KV cache of real torch tensors
(separated K/V, different block counts on each side). D tells P where its blocks are
(``remote_blocks``); P's WRITE producer machine turns each scheduled layer into a
``post_write`` effect, which the driver hands to a handler that posts a layout plan
through ``LoopbackEngine.batch_write`` (the stand-in for mori.io); the completion
poller turns the statuses into events; the machine's ``send_write_done`` effect goes
back to D over ZeroMQ; D then checks every mapped block holds P's bytes.

Run: ``python examples/write_over_loopback.py [--fail-layer N] [--stall-layer N]``.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from moriio_fsm.adapters.zmq import (
    RemoteBlocks,
    Role,
    TransportConfig,
    WriteDone,
    WriteFailed,
    ZmqTransport,
    event_for,
)
from moriio_fsm.engines import CompletionPoller, LoopbackEngine
from moriio_fsm.layout import LayerKVFormat, TransferPlanner
from moriio_fsm.machines import build_table
from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.driver import Driver

KV_FORMAT = LayerKVFormat(block_size=4, num_kv_heads=2, head_size=8)
LAYERS = [f"model.layers.{i}.self_attn" for i in range(4)]
P_NUM_BLOCKS, D_NUM_BLOCKS = 8, 16  # D's block count reaches P in the handshake


def kv_cache(num_blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    shape = (2, num_blocks, KV_FORMAT.block_size, KV_FORMAT.num_kv_heads, KV_FORMAT.head_size)
    make = torch.randn if fill else torch.zeros
    return {name: make(shape, dtype=torch.float16) for name in LAYERS}


class Producer:
    """P's side: the WRITE producer's table, a driver, and one handler per effect kind.

    The handlers only carry out what the machine decided: post a layer's write (planned
    from the block ids the effect carries), tear writes down, tell D, hand blocks back.
    Which remote_blocks counts, when to tell D and when blocks go back is the spec's.
    """

    def __init__(
        self,
        transfer_id: str,
        caches,
        local_block_ids,
        d_engine_desc,
        d_memory,
        d_endpoint,
        fail_layer: int | None = None,
        stall_layer: int | None = None,
    ):
        self.transfer_id = transfer_id
        self.caches = caches
        self.local_block_ids = local_block_ids
        self.engine = LoopbackEngine("prefill")
        self.engine.register_remote_engine(d_engine_desc)
        self.sessions = {}
        for index, name in enumerate(LAYERS):
            local = self.engine.register_torch_tensor(caches[name])
            self.sessions[index] = self.engine.create_session(local, d_memory[name])
        if fail_layer is not None:
            self.engine.faults.fail_nth(fail_layer + 1)
        if stall_layer is not None:
            self.engine.faults.stall_nth(stall_layer + 1)
        self.d_endpoint = d_endpoint
        self.planners: dict[int, TransferPlanner] = {}  # a cache keyed by D's block list
        self.freed = threading.Event()
        self.log: list[str] = []
        self.lock = threading.Lock()
        # A stalled write gets short timeouts, so that it is torn down while the example runs;
        # the others get room for a loaded machine (0.5 s once failed a healthy write under CI).
        limit_s = 0.5 if stall_layer is not None else 5.0
        table = build_table(
            "write_producer",
            check_invariants=True,
            config={"transfer_timeout_s": limit_s, "abandon_timeout_s": limit_s},
            recorder=self.note,
        )
        self.driver = Driver(
            table,
            {
                "post_write": self.post_write,
                "abandon_writes": self.abandon_writes,
                "send_write_done": self.send_write_done,
                "send_write_failed": self.send_write_failed,
                "free_blocks": self.free_blocks,
                "quarantine_blocks": self.free_blocks,
            },
        )
        self.poller = CompletionPoller(self.driver.dispatch)
        self.transport = ZmqTransport(
            TransportConfig(role=Role.PRODUCER, bind_host="127.0.0.1"), self.on_message
        )

    def note(self, event, result) -> None:
        with self.lock:
            self.log.append(f"{event.kind:<22} {result.outcome.value:<9} {result.state}")

    def on_message(self, delivery) -> None:
        self.driver.dispatch(event_for(delivery.message, time.monotonic(), delivery.source))

    # -- handlers: one per effect kind the spec declares ---------------------------------

    def post_write(self, effect) -> None:
        planner = self.planners.get(id(effect.block_ids))
        if planner is None:
            planner = self.planners[id(effect.block_ids)] = TransferPlanner(
                self.local_block_ids, list(effect.block_ids), remote_num_blocks=D_NUM_BLOCKS
            )
        name = LAYERS[effect.layer]
        local, remote, sizes = planner.plan(name, self.caches[name], KV_FORMAT).lists
        session = self.sessions[effect.layer]
        status = session.batch_write(local, remote, sizes, session.allocate_transfer_uid())
        self.poller.submit(status, effect.transfer_id, effect.layer)

    def abandon_writes(self, effect):
        # Tear the stalled writes down and stop polling them; once no byte can still
        # move, say so: the machine goes on only after this answer.
        for layer in effect.layers:
            self.sessions[layer].kill()
        self.poller.forget(effect.transfer_id)
        return events.writes_abandoned(effect.transfer_id, time.monotonic())

    def send_write_done(self, effect) -> None:
        self.transport.send(
            self.d_endpoint, WriteDone(effect.transfer_id, num_writers=effect.num_writers)
        )

    def send_write_failed(self, effect) -> None:
        self.transport.send(self.d_endpoint, WriteFailed(effect.transfer_id))

    def free_blocks(self, effect) -> None:
        self.freed.set()

    def tick(self) -> None:
        self.driver.advance(time.monotonic())

    def close(self) -> None:
        self.poller.close()
        self.transport.close()
        self.engine.close()


def run(
    fail_layer: int | None = None, stall_layer: int | None = None, timeout_s: float = 10.0
) -> dict:
    """Run one transfer; return what D received and whether its blocks match P's."""
    tid = "tx-example-1"
    p_blocks, d_blocks = [1, 3, 4], [9, 2, 14]
    d_caches = kv_cache(D_NUM_BLOCKS, fill=False)
    p_caches = kv_cache(P_NUM_BLOCKS, fill=True)
    d_engine = LoopbackEngine("decode")
    d_memory = {name: d_engine.register_torch_tensor(t) for name, t in d_caches.items()}
    verdict: dict = {}
    got_verdict = threading.Event()

    def on_d_message(delivery) -> None:
        verdict["message"] = delivery.message
        got_verdict.set()

    d_transport = ZmqTransport(
        TransportConfig(role=Role.CONSUMER, bind_host="127.0.0.1"), on_d_message
    )
    producer = Producer(
        tid,
        p_caches,
        p_blocks,
        d_engine.get_engine_desc(),
        d_memory,
        ("127.0.0.1", d_transport.notify_port),
        fail_layer,
        stall_layer,
    )
    try:
        now = time.monotonic
        dispatch = producer.driver.dispatch
        dispatch(events.prefill_started(tid, now(), num_writers=1))
        # D allocated its blocks and tells P where they are, over ZeroMQ.
        d_transport.send(
            ("127.0.0.1", producer.transport.notify_port),
            RemoteBlocks(tid, "req-d-1", tuple(d_blocks), decode_rank=0),
        )
        for index in range(len(LAYERS)):  # the forward pass, layer by layer
            dispatch(events.layer_scheduled(tid, now(), layer=index))
        dispatch(events.seal(tid, now()))
        dispatch(events.request_finished(tid, now()))
        deadline = now() + timeout_s
        while not (got_verdict.is_set() and producer.freed.is_set()) and now() < deadline:
            producer.tick()  # fires the machine's timers
            got_verdict.wait(0.02)
        landed = all(
            torch.equal(d_caches[n][:, d], p_caches[n][:, p])
            for n in LAYERS
            for p, d in zip(p_blocks, d_blocks)
        )
        return {
            "verdict": verdict.get("message"),
            "landed": landed,
            "freed": producer.freed.is_set(),
            "final_state": producer.driver.table.state_of(tid),
            "log": list(producer.log),
        }
    finally:
        producer.close()
        d_transport.close()
        d_engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fail-layer", type=int, default=None, help="inject an RDMA error into this layer's write"
    )
    parser.add_argument(
        "--stall-layer",
        type=int,
        default=None,
        help="make this layer's write never report back (it is torn down)",
    )
    args = parser.parse_args()
    outcome = run(args.fail_layer, args.stall_layer)
    for line in outcome["log"]:
        print("P:", line)
    print("D received:", outcome["verdict"])
    print("bytes landed in D's blocks:", outcome["landed"])
    print("P's blocks handed back:", outcome["freed"], "| final state:", outcome["final_state"])


if __name__ == "__main__":
    main()
