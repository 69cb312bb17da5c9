"""A peer process for the cross-process engine tests: it allocates its own tensor, as vLLM allocates its KV cache.

``engine_peer.py KIND KEY NBYTES`` (KIND: nixl, or mori through the pinned wheel over the stand-in where mori.io
does not import) prints its packed descriptors as one JSON line, then answers JSON-line commands (dump, fill,
pull, push, forget, exit) and starts no transfer between them.
"""

import json
import os
import sys

import torch

WAIT_MS = 10_000


def make_engine(kind: str, key: str):
    if kind == "nixl":
        from moriio_fsm.engines.nixl import NixlEngine

        return NixlEngine(key, "127.0.0.1")
    from moriio_fsm.engines import MoriEngine, probe_mori

    if not probe_mori().available:
        from moriio_fsm.engines import mori_standin

        mori_standin.load_mori_io()
        probe_mori.forget()
    return MoriEngine(key, "127.0.0.1", 0)


def reply(**fields) -> None:
    print(json.dumps(fields), flush=True)


def transfer(engine, mem, command: dict, op: str) -> dict:
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


def main(kind: str, key: str, nbytes: int) -> None:
    with make_engine(kind, key) as engine:
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
            elif op == "forget":  # deregister the tensor: peers must no longer reach it
                engine.deregister_memory(mem)
                reply(ok=True)
            else:
                break


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
