"""Throughput of LoopbackEngine.batch_write across two processes against a plain torch copy.

Rules: process D owns a 256 MiB shared tensor; P writes it in 64 KiB and 1 MiB chunks at scattered offsets
(no two merge) and, in the same rounds, with one ``Tensor.copy_``; ratios are medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time

import torch

from moriio_fsm.adapters.moriio import LoopbackEngine
from moriio_fsm.adapters.moriio.shared_memory import PeerMapping

MIB = 1 << 20


def run_decode_side(conn, total_bytes: int) -> None:
    """Process D: own the destination tensor, answer spot checks, do nothing else."""
    with LoopbackEngine("bench-decode") as engine:
        cache = engine.allocate_shared_tensor(total_bytes)
        mem = engine.register_torch_tensor(cache)
        conn.send((engine.get_engine_desc().pack(), mem.pack()))
        while True:
            request = conn.recv()
            if request[0] == "stop":
                break
            # ("check", [(offset, expected_bytes), ...]): did the writes land here?
            conn.send(all(bytes(cache[o:o + len(b)].tolist()) == b for o, b in request[1]))
    conn.close()


def scattered_offsets(total_bytes: int, chunk: int, seed: int) -> tuple[list[int], list[int], list[int]]:
    count = total_bytes // chunk
    destinations = list(range(count))
    random.Random(seed).shuffle(destinations)
    return [i * chunk for i in range(count)], [d * chunk for d in destinations], [chunk] * count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="bytes to move per round, in MiB")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per chunk size")
    args = parser.parse_args()
    total = args.mib * MIB

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    decode = ctx.Process(target=run_decode_side, args=(there, total), daemon=True)
    decode.start()
    ratios = {}
    try:
        if not here.poll(120):
            raise RuntimeError("decode process did not start within 120 s")
        engine_desc_bytes, mem_bytes = here.recv()
        with LoopbackEngine("bench-prefill") as engine:
            source = engine.allocate_shared_tensor(total)
            source.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
            local_mem = engine.register_torch_tensor(source)
            remote_engine = engine.unpack_engine_desc(engine_desc_bytes)
            remote_mem = engine.unpack_memory_desc(mem_bytes)
            engine.register_remote_engine(remote_engine)
            session = engine.create_session(local_mem, remote_mem)
            if session is None:
                raise RuntimeError("could not open a session to the decode process")
            # The baseline copies into the very same shared pages, mapped here.
            destination = PeerMapping(remote_mem.pid, remote_mem.region_fd,
                                      remote_mem.region_token, remote_mem.size).tensor

            for label, chunk in (("64k", 64 << 10), ("1m", MIB)):
                lo, ro, sizes = scattered_offsets(total, chunk, seed=chunk)
                project_s, plain_s = [], []
                for round_index in range(args.rounds + 1):
                    start = time.perf_counter()
                    destination.copy_(source)
                    plain = time.perf_counter() - start

                    start = time.perf_counter()
                    status = session.batch_write(lo, ro, sizes, session.allocate_transfer_uid())
                    status.wait()
                    project = time.perf_counter() - start
                    if not status.succeeded():
                        raise RuntimeError(f"batch_write failed: {status.message()}")
                    if round_index:  # the first round only warms caches and page tables
                        plain_s.append(plain)
                        project_s.append(project)
                checks = [(ro[i], bytes(source[lo[i]:lo[i] + 64].tolist()))
                          for i in (0, len(lo) // 2, len(lo) - 1)]
                here.send(("check", checks))
                if not here.recv():
                    raise RuntimeError(f"{label}: the decode process does not see the written bytes")
                ratios[label] = statistics.median(plain_s) / statistics.median(project_s)
                print(f"{label}: loopback {total / statistics.median(project_s) / 1e9:.2f} GB/s, "
                      f"plain copy {total / statistics.median(plain_s) / 1e9:.2f} GB/s", flush=True)
            del destination
    finally:
        try:
            here.send(("stop",))
        except OSError:
            pass
        decode.join(30)
        if decode.is_alive():
            decode.kill()
            decode.join()
    print(f"copy_ratio_64k: {ratios['64k']:.3f}")
    print(f"copy_ratio_1m: {ratios['1m']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
