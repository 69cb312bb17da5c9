"""A peer process for the cross-memory tests: it allocates its own tensor, as vLLM allocates its KV cache.

Roles (argv[1]): ``owner KEY NBYTES [N,H,B,D] [share] [help]`` prints its packed descriptors as one JSON line,
then answers JSON-line commands (dump, fill, deregister, pull, assist, exit) and runs no transfer code between them
(``share``: its engine shares the tensor's pages, so peers copy into them by memcpy; ``help``: a thread asks its
engine to help peers' writes without pause, as vLLM's engine loop does while a request waits for KV);
``intruder ENGINE MEMORY WHEN`` drops to uid 65534 before or after attaching and reports what the engine said.
"""

import json
import os
import sys
import threading

import torch

from moriio_fsm.engines.same_host import CrossMemoryEngine, CrossMemoryError

NOBODY = 65534
WAIT_MS = 10_000


def reply(**fields) -> None:
    print(json.dumps(fields), flush=True)


def owner(key: str, nbytes: int, kv_shape: str | None, share: bool, helping: bool) -> None:
    with CrossMemoryEngine(key, share_pages=share) as engine:
        if helping:
            threading.Thread(
                target=lambda: [engine.help_writers(0.002, 0.0005) for _ in iter(int, 1)],
                daemon=True,
            ).start()
        if kv_shape:
            num_blocks, heads, block_size, head_size = (int(v) for v in kv_shape.split(","))
            # The CPU attention backend's per-layer cache: [num_blocks, num_kv_heads, block_size, 2*head_size].
            cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=torch.float16)
        else:
            cache = torch.zeros(nbytes, dtype=torch.uint8)
        flat = cache.view(-1).view(torch.uint8)
        mem = engine.register_torch_tensor(cache)
        reply(
            engine=engine.get_engine_desc().pack().hex(),
            memory=mem.pack().hex(),
            pid=os.getpid(),
            shares_pages=mem.shares_pages,
        )
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            if op == "dump":
                reply(
                    hex=flat[command["offset"] : command["offset"] + command["size"]]
                    .numpy()
                    .tobytes()
                    .hex()
                )
            elif op == "fill":
                data = bytearray.fromhex(command["hex"])
                flat[command["offset"] : command["offset"] + len(data)] = torch.frombuffer(
                    data, dtype=torch.uint8
                )
                reply(ok=True)
            elif op == "deregister":
                engine.deregister_memory(mem)
                reply(ok=True)
            elif op == "assist":
                reply(**engine._board.stats())
            elif op == "pull":
                reply(**pull(engine, mem, command))
            else:
                break


def pull(engine: CrossMemoryEngine, mem, command: dict) -> dict:
    """This process reads the other one's memory into its own tensor (READ mode: D pulls from P)."""
    remote_engine = engine.unpack_engine_desc(bytes.fromhex(command["engine"]))
    engine.register_remote_engine(remote_engine)
    session = engine.create_session(
        mem, engine.unpack_memory_desc(bytes.fromhex(command["memory"]))
    )
    if session is None:
        return {"code": -1, "message": "no session"}
    status = session.batch_read(
        command["local_offsets"],
        command["remote_offsets"],
        command["sizes"],
        session.allocate_transfer_uid(),
    )
    status.wait_for(WAIT_MS)
    return {"code": status.code(), "message": status.message()}


def intruder(engine_hex: str, memory_hex: str, when: str) -> None:
    """Try to write into the other process as an unprivileged user; report the error or the status."""
    with CrossMemoryEngine("intruder") as engine:
        source = torch.full((4096,), 7, dtype=torch.uint8)
        local = engine.register_torch_tensor(source)
        remote_engine = engine.unpack_engine_desc(bytes.fromhex(engine_hex))
        if when == "before_attach":
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        try:
            engine.register_remote_engine(remote_engine)
        except CrossMemoryError as exc:
            reply(attach_error=str(exc), errno=exc.errno)
            return
        session = engine.create_session(local, engine.unpack_memory_desc(bytes.fromhex(memory_hex)))
        os.setgid(NOBODY)
        os.setuid(NOBODY)  # glibc drops every thread's credentials, the engine's worker too
        status = session.batch_write([0], [0], [4096], session.allocate_transfer_uid())
        status.wait_for(WAIT_MS)
        reply(code=status.code(), message=status.message(), alive=session.alive())


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "owner":
        options = sys.argv[4:]
        shape = next((option for option in options if option not in ("share", "help")), None)
        owner(sys.argv[2], int(sys.argv[3]), shape, "share" in options, "help" in options)
    elif role == "intruder":
        intruder(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown role {role!r}; expected owner or intruder")
