"""A peer process for the NIXL engine tests: it allocates its own tensor, as vLLM allocates its KV cache.

``nixl_peer.py KEY NBYTES`` prints its packed descriptors as one JSON line, then answers JSON-line commands (dump,
fill, pull, push, exit) and starts no transfer between them; its engine's thread only progresses UCX.
"""

import json
import os
import sys

import torch

from moriio_fsm.engines.nixl import NixlEngine

WAIT_MS = 10_000


def reply(**fields) -> None:
    print(json.dumps(fields), flush=True)


def transfer(engine: NixlEngine, mem, command: dict, op: str) -> dict:
    """This process reads the other one's memory into its tensor, or writes its tensor into the other's."""
    engine.register_remote_engine(engine.unpack_engine_desc(bytes.fromhex(command["engine"])))
    session = engine.create_session(
        mem, engine.unpack_memory_desc(bytes.fromhex(command["memory"]))
    )
    if session is None:
        return {"code": -1, "message": "no session"}
    post = session.batch_read if op == "pull" else session.batch_write
    status = post(
        command["local_offsets"],
        command["remote_offsets"],
        command["sizes"],
        session.allocate_transfer_uid(),
    )
    status.wait_for(WAIT_MS)
    return {"code": status.code(), "message": status.message()}


def main(key: str, nbytes: int) -> None:
    with NixlEngine(key, "127.0.0.1") as engine:
        cache = torch.zeros(nbytes, dtype=torch.uint8)
        mem = engine.register_torch_tensor(cache)
        reply(
            engine=engine.get_engine_desc().pack().hex(), memory=mem.pack().hex(), pid=os.getpid()
        )
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            if op == "dump":
                reply(
                    hex=cache[command["offset"] : command["offset"] + command["size"]]
                    .numpy()
                    .tobytes()
                    .hex()
                )
            elif op == "fill":
                data = bytearray.fromhex(command["hex"])
                cache[command["offset"] : command["offset"] + len(data)] = torch.frombuffer(
                    data, dtype=torch.uint8
                )
                reply(ok=True)
            elif op in ("pull", "push"):
                reply(**transfer(engine, mem, command, op))
            else:
                break


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
