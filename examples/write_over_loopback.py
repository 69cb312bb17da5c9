"""One WRITE-mode transfer end to end on one host: every part real but the RDMA wire.

P and D each own a ZeroMQ transport on 127.0.0.1 and a KV cache of real torch tensors
(separated K/V, different block counts on each side). D tells P where its blocks are
(``remote_blocks``); P's WRITE producer machine turns each scheduled layer into a
``post_writes`` effect, which this driver executes as a layout plan posted through
``LoopbackEngine.batch_write`` (the stand-in for mori.io); the completion poller turns
the statuses into events; the machine's ``send_write_done`` effect goes back to D over
ZeroMQ; D then checks every mapped block holds P's bytes.

Run: ``python examples/write_over_loopback.py [--fail-layer N]``.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from moriio_fsm.adapters.moriio import CompletionPoller, LoopbackEngine
from moriio_fsm.adapters.zmq import (RemoteBlocks, Role, TransportConfig, WriteDone,
                                     WriteFailed, ZmqTransport)
from moriio_fsm.layout import LayerKVFormat, TransferPlanner
from moriio_fsm.machines import build_table
from moriio_fsm.runtime.events import Event

KV_FORMAT = LayerKVFormat(block_size=4, num_kv_heads=2, head_size=8)
LAYERS = [f"model.layers.{i}.self_attn" for i in range(4)]
P_NUM_BLOCKS, D_NUM_BLOCKS = 8, 16      # D's block count reaches P in the handshake


def kv_cache(num_blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    shape = (2, num_blocks, KV_FORMAT.block_size, KV_FORMAT.num_kv_heads, KV_FORMAT.head_size)
    make = torch.randn if fill else torch.zeros
    return {name: make(shape, dtype=torch.float16) for name in LAYERS}


class ProducerDriver:
    """Executes the WRITE producer's effects: posts writes, tells D, frees blocks."""

    def __init__(self, transfer_id: str, caches, local_block_ids, d_engine_desc, d_memory,
                 d_endpoint, fail_layer: int | None = None):
        self.transfer_id = transfer_id
        self.caches = caches
        self.local_block_ids = local_block_ids
        self.table = build_table("write_producer", check_invariants=True)
        self.engine = LoopbackEngine("prefill")
        self.engine.register_remote_engine(d_engine_desc)
        self.sessions = {}
        for index, name in enumerate(LAYERS):
            local = self.engine.register_torch_tensor(caches[name])
            self.sessions[index] = self.engine.create_session(local, d_memory[name])
        if fail_layer is not None:
            self.engine.faults.fail_nth(fail_layer + 1)
        self.d_endpoint = d_endpoint
        self.planner = None
        self.planner_lock = threading.Lock()    # plans are made on the I/O and main threads
        self.poller = CompletionPoller(self.dispatch)
        self.transport = ZmqTransport(TransportConfig(role=Role.PRODUCER, bind_host="127.0.0.1"),
                                      self.on_message)
        self.freed = threading.Event()
        self.log: list[str] = []
        self.lock = threading.Lock()

    def on_message(self, delivery) -> None:
        if isinstance(delivery.message, RemoteBlocks) and self.planner is None:
            self.planner = TransferPlanner(self.local_block_ids, list(delivery.message.block_ids),
                                           remote_num_blocks=D_NUM_BLOCKS)
        self.dispatch(delivery.event)

    def dispatch(self, event: Event) -> None:
        result = self.table.dispatch(event)
        with self.lock:
            self.log.append(f"{event.kind:<16} {result.outcome.value:<9} {result.state}")
        for effect in result.effects:
            self.execute(effect)

    def execute(self, effect) -> None:
        if effect.kind == "post_writes":
            for layer in effect.data["layers"]:
                name = LAYERS[layer]
                with self.planner_lock:
                    plan = self.planner.plan(name, self.caches[name], KV_FORMAT)
                local, remote, sizes = plan.lists
                session = self.sessions[layer]
                status = session.batch_write(local, remote, sizes, session.allocate_transfer_uid())
                self.poller.submit(status, self.transfer_id, layer)
        elif effect.kind == "send_write_done":
            self.transport.send(self.d_endpoint, WriteDone(self.transfer_id,
                                                           num_writers=effect.data["num_writers"]))
        elif effect.kind == "send_write_failed":
            self.transport.send(self.d_endpoint, WriteFailed(self.transfer_id))
        elif effect.kind == "abandon_writes":
            # Tear the stalled writes down and stop polling them; once no byte can
            # still move, say so.
            for layer in effect.data["layers"]:
                self.sessions[layer].kill()
            self.poller.forget(self.transfer_id)
            self.dispatch(Event(self.transfer_id, "writes_abandoned", time.monotonic()))
        elif effect.kind == "free_blocks":
            self.freed.set()

    def close(self) -> None:
        self.poller.close()
        self.transport.close()
        self.engine.close()


def run(fail_layer: int | None = None, timeout_s: float = 10.0) -> dict:
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

    d_transport = ZmqTransport(TransportConfig(role=Role.CONSUMER, bind_host="127.0.0.1"),
                               on_d_message)
    producer = ProducerDriver(tid, p_caches, p_blocks, d_engine.get_engine_desc(), d_memory,
                              ("127.0.0.1", d_transport.notify_port), fail_layer)
    try:
        now = time.monotonic
        producer.dispatch(Event(tid, "create", now(), {"num_writers": 1}))
        # D allocated its blocks and tells P where they are, over ZeroMQ.
        d_transport.send(("127.0.0.1", producer.transport.notify_port),
                         RemoteBlocks(tid, "req-d-1", tuple(d_blocks), decode_rank=0))
        for index in range(len(LAYERS)):          # the forward pass, layer by layer
            producer.dispatch(Event(tid, "layer_scheduled", now(), {"layer": index}))
        producer.dispatch(Event(tid, "seal", now()))
        producer.dispatch(Event(tid, "request_finished", now()))
        got_verdict.wait(timeout_s)
        producer.freed.wait(timeout_s)
        landed = all(torch.equal(d_caches[n][:, d], p_caches[n][:, p])
                     for n in LAYERS for p, d in zip(p_blocks, d_blocks))
        return {"verdict": verdict.get("message"), "landed": landed,
                "freed": producer.freed.is_set(), "final_state": producer.table.state_of(tid),
                "log": list(producer.log)}
    finally:
        producer.close()
        d_transport.close()
        d_engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-layer", type=int, default=None,
                        help="inject an RDMA error into this layer's write")
    args = parser.parse_args()
    outcome = run(args.fail_layer)
    for line in outcome["log"]:
        print("P:", line)
    print("D received:", outcome["verdict"])
    print("bytes landed in D's blocks:", outcome["landed"])
    print("P's blocks handed back:", outcome["freed"], "| final state:", outcome["final_state"])


if __name__ == "__main__":
    main()
