"""A connector worker half in its own process, driven over stdin/stdout with JSON lines.

Each input line is one command, answered by one output line. ``open`` starts a named
``WorkerHalf`` (side, mode, layout, ports on 127.0.0.1) over a KV cache this process
allocates itself, as vLLM would (P's random, D's -1), optionally as one TP rank holding
``heads`` KV heads; ``send`` / ``receive`` / ``end`` apply one step's metadata to it;
``poll`` answers what vLLM would be told; ``digest`` hashes the bytes of some blocks (or of
some of their heads); ``pristine`` says whether the others are untouched;
``close`` and ``quit`` stop workers and the process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time

import torch

from moriio_fsm.engines.same_host import CrossMemoryEngine
from moriio_fsm.layout import CPU_ATTN, LayerKVFormat
from moriio_fsm.vllm.metadata import ReceiveStart, RequestEnded, SendStart, StepMetadata
from moriio_fsm.vllm.params import PeerAddress
from moriio_fsm.vllm.settings import ConnectorSettings
from moriio_fsm.vllm.worker_half import WorkerHalf

NUM_BLOCKS, BLOCK, HEADS, HEAD = 12, 16, 2, 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]

#: layout -> (shape, LayerKVFormat): every layout the planner supports, with HEADS heads.
LAYOUTS = {
    "separated_nhd": ((2, NUM_BLOCKS, BLOCK, HEADS, HEAD), LayerKVFormat(BLOCK, HEADS, HEAD)),
    "separated_hnd": ((2, NUM_BLOCKS, HEADS, BLOCK, HEAD), LayerKVFormat(BLOCK, HEADS, HEAD)),
    "interleaved_nhd": ((NUM_BLOCKS, 2, BLOCK, HEADS, HEAD), LayerKVFormat(BLOCK, HEADS, HEAD)),
    "interleaved_hnd": ((NUM_BLOCKS, 2, HEADS, BLOCK, HEAD), LayerKVFormat(BLOCK, HEADS, HEAD)),
    "mla": ((NUM_BLOCKS, BLOCK, 24), LayerKVFormat(BLOCK, use_mla=True)),
    "cpu_attn": (
        (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD),
        LayerKVFormat(BLOCK, HEADS, HEAD, attention_backend=CPU_ATTN),
    ),
}


#: layout -> the heads axis of one block's view (``block_view``).
HEADS_AXIS = {
    "separated_nhd": 2,
    "separated_hnd": 1,
    "interleaved_nhd": 2,
    "interleaved_hnd": 1,
    "cpu_attn": 0,
}


def block_view(tensor: torch.Tensor, layout: str, block: int) -> torch.Tensor:
    return tensor[:, block] if layout.startswith("separated") else tensor[block]


def with_heads(layout: str, heads: int) -> tuple[tuple[int, ...], LayerKVFormat]:
    """The layout's shape and format with ``heads`` KV heads instead of HEADS."""
    shape, kv_format = LAYOUTS[layout]
    if heads == HEADS:
        return shape, kv_format
    axis = HEADS_AXIS[layout] + 1  # a block's view drops the blocks axis in front of it
    resized = shape[:axis] + (heads,) + shape[axis + 1 :]
    return resized, dataclasses.replace(kv_format, num_kv_heads=heads)


def open_worker(
    side: str,
    mode: str,
    layout: str,
    notify: int,
    handshake: int,
    tp: tuple[int, int] = (0, 1),
    heads: int = HEADS,
):
    shape, kv_format = with_heads(layout, heads)
    settings = ConnectorSettings.from_extra_config(
        {
            "backend": "same_host",
            "read_mode": mode == "read",
            "notify_port": notify,
            "handshake_port": handshake,
            "host_ip": "127.0.0.1",
            "tick_interval": 0.005,
        }
    )
    if side == "send":
        generator = torch.Generator().manual_seed(7 + tp[0])
        caches = {
            name: torch.randn(shape, generator=generator, dtype=torch.float32) for name in LAYERS
        }
    else:
        caches = {name: torch.full(shape, -1.0) for name in LAYERS}
    worker = WorkerHalf(
        settings,
        engine_id=f"{side}-{layout}-{mode}",
        sides=(side,),
        tp_rank=tp[0],
        tp_size=tp[1],
        dp_rank=0,
        host="127.0.0.1",
        make_engine=lambda key: CrossMemoryEngine(key, "127.0.0.1"),
    )
    worker.register_kv_caches(
        caches, kv_format, attention_backend=kv_format.attention_backend or ""
    )
    return worker, caches, layout, side


def handle(workers: dict, command: dict) -> dict:
    op = command["op"]
    if op == "open":
        workers[command["name"]] = open_worker(
            command["side"],
            command["mode"],
            command["layout"],
            command["notify"],
            command["handshake"],
            tuple(command.get("tp", (0, 1))),
            command.get("heads", HEADS),
        )
        return {"ok": op}
    worker, caches, layout, side = workers[command["name"]]
    peer = PeerAddress(**command["peer"]) if command.get("peer") else None
    blocks = tuple(command.get("blocks", ()))
    if op == "send":
        worker.start_step(
            StepMetadata(sends=[SendStart(command["req"], command["tid"], blocks, peer)])
        )
        worker.finish_saves()
    elif op == "receive":
        worker.start_step(
            StepMetadata(
                receives=[
                    ReceiveStart(
                        command["req"],
                        command["tid"],
                        blocks,
                        peer,
                        tuple(command.get("remote_blocks", ())),
                    )
                ]
            )
        )
    elif op == "end":
        worker.start_step(
            StepMetadata(
                ended=[
                    RequestEnded(
                        command["req"], command["tid"], side, command["awaits"], False, blocks, peer
                    )
                ]
            )
        )
    elif op == "poll":
        deadline = time.monotonic() + command.get("wait_s", 0.0)
        sending, recving = set(), set()
        while True:
            got = worker.finished()
            sending |= got[0]
            recving |= got[1]
            if sending or recving or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        return {
            "sending": sorted(sending),
            "recving": sorted(recving),
            "load_errors": sorted(worker.load_errors()),
        }
    elif op == "digest":
        digest = hashlib.sha256()
        start, count = command.get("heads", (0, None))
        for name in LAYERS:
            for block in blocks:
                view = block_view(caches[name], layout, block)
                if count is not None:
                    view = view.narrow(HEADS_AXIS[layout], start, count)
                digest.update(view.contiguous().numpy().tobytes())
        return {"digest": digest.hexdigest()}
    elif op == "pristine":
        # True when every block not listed still holds this process's initial -1s.
        listed = set(blocks)
        return {
            "pristine": all(
                bool((block_view(caches[name], layout, b) == -1).all())
                for name in LAYERS
                for b in range(NUM_BLOCKS)
                if b not in listed
            )
        }
    elif op == "close":
        worker.close()
        del workers[command["name"]]
    return {"ok": op}


def main() -> None:
    workers: dict = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        try:
            reply = handle(workers, command)
        except Exception as exc:  # the test sees the error instead of a hang
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    for worker, *_ in workers.values():
        worker.close()


if __name__ == "__main__":
    main()
