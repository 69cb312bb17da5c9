"""Benchmark: the same-host engine's in-process copier against one ctypes.memmove per range.

The shape is one request of the serving race: 18 MiB of KV in 144 ranges of 128 KiB, read
from memory this process has just written (as P's forward leaves it) and written to scattered
blocks of a 1 GiB shared mapping (a peer's KV cache, never in this core's cache). Both copiers
run in the same run, alternating, on one core if ``taskset`` confines the process; prints the
median time and bandwidth of each and the ratio last.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import random
import statistics
import time

from moriio_fsm.engines.same_host import local_copy

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranges", type=int, default=144, help="ranges per copy (default 144)")
    parser.add_argument(
        "--range-kib", type=int, default=128, help="bytes per range, KiB (default 128)"
    )
    parser.add_argument("--rounds", type=int, default=60, help="copies per copier (default 60)")
    parser.add_argument(
        "--cache-mib", type=int, default=1024, help="destination mapping, MiB (default 1024)"
    )
    args = parser.parse_args(argv)
    size = args.range_kib * 1024
    nbytes = args.ranges * size
    fd = os.memfd_create("bench-local-copy")
    os.ftruncate(fd, args.cache_mib * MiB)
    cache = mmap.mmap(
        fd, args.cache_mib * MiB, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    )
    os.close(fd)
    cache_base = ctypes.addressof(ctypes.c_char.from_buffer(cache))
    ctypes.memset(cache_base, 1, args.cache_mib * MiB)  # every page backed before timing
    source = (ctypes.c_char * nbytes)()
    source_base = ctypes.addressof(source)
    blocks = args.cache_mib * MiB // size
    rng = random.Random(0)
    copiers = {"native": local_copy.copy_ranges, "memmove": local_copy.memmove_ranges}
    if local_copy.copy_ranges is local_copy.memmove_ranges:
        print("the native copier is not built here: both rows are memmove")
    times: dict[str, list[float]] = {name: [] for name in copiers}
    for round_index in range(args.rounds):
        for name, copy in copiers.items():
            targets = rng.sample(range(blocks), args.ranges)
            ctypes.memset(source_base, round_index & 0xFF, nbytes)  # the source fresh in cache
            started = time.perf_counter()
            copy(
                cache_base,
                [b * size for b in targets],
                source_base,
                [i * size for i in range(args.ranges)],
                [size] * args.ranges,
            )
            times[name].append(time.perf_counter() - started)
    print(
        f"{args.ranges} ranges x {args.range_kib} KiB = {nbytes / MiB:.1f} MiB into a {args.cache_mib} MiB "
        f"shared mapping; copier: {local_copy.copier()}; medians of {args.rounds}"
    )
    medians = {name: statistics.median(values[3:] or values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:8s} {median * 1e3:7.3f} ms  {nbytes / median / 1e9:6.2f} GB/s")
    del source
    cache.close()
    print(f"native_vs_memmove_time: {medians['native'] / medians['memmove']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
