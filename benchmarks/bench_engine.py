"""Throughput of the transfer engines' batch_write across two processes against a plain torch copy.

Rules: process D owns a 256 MiB shared tensor (loopback) and 256 MiB tensors it allocated itself (cross-memory, and
NixlEngine over UCX TCP and over UCX shared memory, where nixl imports); P writes each in 64 KiB and 1 MiB chunks at
scattered offsets (no two merge) and, in the same rounds, with one ``Tensor.copy_``; ratios are medians of
interleaved rounds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time

import torch

from moriio_fsm.engines import LoopbackEngine
from moriio_fsm.engines.nixl import probe_nixl
from moriio_fsm.engines.same_host import CrossMemoryEngine
from moriio_fsm.engines.shared_memory import PeerMapping

MIB = 1 << 20
# NIXL engines measured, by name: the UCX transports each runs with (both 127.0.0.1). TCP alone
# moves bytes through D's socket (D's engine thread progresses UCX to take them); with "sm"
# UCX writes by cross-memory attach, as the same-host engine does.
NIXL_TRANSPORTS = {"nixl-tcp": "tcp,self", "nixl-sm": "tcp,self,sm"}


def nixl_engines(side: str) -> dict:
    """One NixlEngine per transport, or none (with the reason printed by P) when nixl does not import."""
    if not probe_nixl().available:
        return {}
    from moriio_fsm.engines.nixl import NixlEngine

    return {
        name: NixlEngine(f"bench-{side}-{name}", "127.0.0.1", ucx={"UCX_TLS": tls})
        for name, tls in NIXL_TRANSPORTS.items()
    }


def run_decode_side(conn, total_bytes: int) -> None:
    """Process D: own the destination tensors, answer spot checks, do nothing else."""
    with LoopbackEngine("bench-decode") as engine, CrossMemoryEngine("bench-decode-cma") as cma:
        caches = {
            "loopback": engine.allocate_shared_tensor(total_bytes),
            # Allocated here, as vLLM allocates its KV cache: no shared memory involved.
            "cross-memory": torch.zeros(total_bytes, dtype=torch.uint8),
        }
        mem = engine.register_torch_tensor(caches["loopback"])
        cma_mem = cma.register_torch_tensor(caches["cross-memory"])
        nixl = nixl_engines("decode")
        try:
            nixl_descs = {}
            for name, nixl_engine in nixl.items():
                caches[name] = torch.zeros(total_bytes, dtype=torch.uint8)
                nixl_descs[name] = (
                    nixl_engine.get_engine_desc().pack(),
                    nixl_engine.register_torch_tensor(caches[name]).pack(),
                )
            conn.send(
                (
                    engine.get_engine_desc().pack(),
                    mem.pack(),
                    cma.get_engine_desc().pack(),
                    cma_mem.pack(),
                    nixl_descs,
                )
            )
            while True:
                request = conn.recv()
                if request[0] == "stop":
                    break
                # ("check", engine, [(offset, expected_bytes), ...]): did the writes land here?
                cache = caches[request[1]]
                conn.send(all(bytes(cache[o : o + len(b)].tolist()) == b for o, b in request[2]))
        finally:
            for nixl_engine in nixl.values():
                nixl_engine.close()
    conn.close()


def scattered_offsets(
    total_bytes: int, chunk: int, seed: int
) -> tuple[list[int], list[int], list[int]]:
    count = total_bytes // chunk
    destinations = list(range(count))
    random.Random(seed).shuffle(destinations)
    return [i * chunk for i in range(count)], [d * chunk for d in destinations], [chunk] * count


def timed_write(session, lo: list[int], ro: list[int], sizes: list[int]) -> float:
    """Seconds from posting one batch to its final status; raises if it failed."""
    start = time.perf_counter()
    status = session.batch_write(lo, ro, sizes, session.allocate_transfer_uid())
    status.wait()
    seconds = time.perf_counter() - start
    if not status.succeeded():
        raise RuntimeError(f"batch_write failed: {status.message()}")
    return seconds


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
    nixl: dict = {}
    try:
        if not here.poll(120):
            raise RuntimeError("decode process did not start within 120 s")
        engine_desc_bytes, mem_bytes, cma_desc_bytes, cma_mem_bytes, nixl_descs = here.recv()
        if not nixl_descs:
            print(f"nixl: not measured ({probe_nixl().reason})", flush=True)
        nixl = nixl_engines("prefill") if nixl_descs else {}
        with (
            LoopbackEngine("bench-prefill") as engine,
            CrossMemoryEngine("bench-prefill-cma") as cma,
        ):
            source = engine.allocate_shared_tensor(total)
            source.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
            local_mem = engine.register_torch_tensor(source)
            remote_engine = engine.unpack_engine_desc(engine_desc_bytes)
            remote_mem = engine.unpack_memory_desc(mem_bytes)
            engine.register_remote_engine(remote_engine)
            cma.register_remote_engine(cma.unpack_engine_desc(cma_desc_bytes))
            sessions = {
                "loopback": engine.create_session(local_mem, remote_mem),
                "cross-memory": cma.create_session(
                    cma.register_torch_tensor(source), cma.unpack_memory_desc(cma_mem_bytes)
                ),
            }
            for name, nixl_engine in nixl.items():
                nixl_engine.register_remote_engine(
                    nixl_engine.unpack_engine_desc(nixl_descs[name][0])
                )
                sessions[name] = nixl_engine.create_session(
                    nixl_engine.register_torch_tensor(source),
                    nixl_engine.unpack_memory_desc(nixl_descs[name][1]),
                )
            if None in sessions.values():
                raise RuntimeError(f"could not open a session to the decode process: {sessions}")
            # The baseline copies into the very same shared pages, mapped here.
            destination = PeerMapping(
                remote_mem.pid, remote_mem.region_fd, remote_mem.region_token, remote_mem.size
            ).tensor

            for label, chunk in (("64k", 64 << 10), ("1m", MIB)):
                lo, ro, sizes = scattered_offsets(total, chunk, seed=chunk)
                plain_s, engine_s = [], {name: [] for name in sessions}
                for round_index in range(args.rounds + 1):
                    start = time.perf_counter()
                    destination.copy_(source)
                    plain = time.perf_counter() - start
                    took = {
                        name: timed_write(session, lo, ro, sizes)
                        for name, session in sessions.items()
                    }
                    if round_index:  # the first round only warms caches and page tables
                        plain_s.append(plain)
                        for name, seconds in took.items():
                            engine_s[name].append(seconds)
                checks = [
                    (ro[i], bytes(source[lo[i] : lo[i] + 64].tolist()))
                    for i in (0, len(lo) // 2, len(lo) - 1)
                ]
                for name in sessions:
                    here.send(("check", name, checks))
                    if not here.recv():
                        raise RuntimeError(
                            f"{label}: the decode process does not see the bytes {name} wrote"
                        )
                plain_median = statistics.median(plain_s)
                medians = {name: statistics.median(seconds) for name, seconds in engine_s.items()}
                ratios[label] = {name: plain_median / median for name, median in medians.items()}
                ratios[label]["cross-memory/loopback"] = (
                    medians["loopback"] / medians["cross-memory"]
                )
                print(
                    f"{label}: loopback {total / medians['loopback'] / 1e9:.2f} GB/s, "
                    f"plain copy {total / plain_median / 1e9:.2f} GB/s",
                    flush=True,
                )
                print(
                    f"{label}: cross-memory {total / medians['cross-memory'] / 1e9:.2f} GB/s "
                    "(into a tensor D allocated itself)",
                    flush=True,
                )
                for name in nixl:
                    ratios[label][f"{name}/cross-memory"] = medians["cross-memory"] / medians[name]
                    print(
                        f"{label}: {name} {total / medians[name] / 1e9:.2f} GB/s "
                        f"(UCX_TLS={NIXL_TRANSPORTS[name]}, into a tensor D allocated itself)",
                        flush=True,
                    )
            del destination
    finally:
        for nixl_engine in nixl.values():
            nixl_engine.close()
        try:
            here.send(("stop",))
        except OSError:
            pass
        decode.join(30)
        if decode.is_alive():
            decode.kill()
            decode.join()
    for label in ("64k", "1m"):
        print(f"copy_ratio_{label}: {ratios[label]['loopback']:.3f}")
    for label in ("64k", "1m"):
        print(f"cross_memory_copy_ratio_{label}: {ratios[label]['cross-memory']:.3f}")
    for label in ("64k", "1m"):
        print(f"cross_memory_vs_loopback_{label}: {ratios[label]['cross-memory/loopback']:.3f}")
    for name in nixl:
        key = name.replace("-", "_")
        for label in ("64k", "1m"):
            print(f"{key}_copy_ratio_{label}: {ratios[label][name]:.3f}")
        for label in ("64k", "1m"):
            print(f"{key}_vs_cross_memory_{label}: {ratios[label][f'{name}/cross-memory']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
