"""Benchmark: vectorized transfer planning against a per-block Python loop, cache hit vs miss.

Plans a 64-layer model (separated, HND, interleaved kernel-block and MLA layers) for a
4,096-block transfer both ways in the same run, each ending in the three Python lists an
engine's batch call receives, checks both give identical lists, and prints medians of
repeated rounds as ratios (the machine is shared and noisy).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from moriio_fsm.layout import (
    KVLayout,
    LayerGeometry,
    LayerKVFormat,
    TransferPlanner,
    as_block_ids,
    describe_layer,
    plan_transfer,
)

NUM_LAYERS = 64
NUM_TRANSFER_BLOCKS = 4096
LOCAL_CACHE_BLOCKS = 12288
REMOTE_CACHE_BLOCKS = 16384
ROUNDS = 11
LOOKUPS_PER_ROUND = 200


def build_model() -> list[tuple[str, torch.Tensor, LayerKVFormat]]:
    """Meta tensors: real geometry (shape, strides, dtype) without allocating the cache."""
    n = LOCAL_CACHE_BLOCKS
    dense = LayerKVFormat(block_size=16, num_kv_heads=8, head_size=128)
    kernel = LayerKVFormat(block_size=64, num_kv_heads=8, head_size=128)
    mla = LayerKVFormat(block_size=64, head_size=576, use_mla=True)
    layers = []
    for index in range(NUM_LAYERS):
        kind = index % 4
        if kind == 0:
            tensor, kv_format = (
                torch.empty(2, n, 16, 8, 128, dtype=torch.bfloat16, device="meta"),
                dense,
            )
        elif kind == 1:
            hnd = torch.empty(2, n, 8, 16, 128, dtype=torch.float16, device="meta")
            tensor, kv_format = hnd.permute(0, 1, 3, 2, 4), dense
        elif kind == 2:
            tensor, kv_format = (
                torch.empty(n * 4, 2, 16, 8, 128, dtype=torch.bfloat16, device="meta"),
                kernel,
            )
        else:
            tensor, kv_format = torch.empty(n, 64, 576, dtype=torch.bfloat16, device="meta"), mla
        layers.append((f"model.layers.{index}", tensor, kv_format))
    return layers


def block_mapping(seed: int = 0) -> tuple[list[int], list[int]]:
    """Fragmented allocations: short runs of consecutive blocks in random places."""
    rng = random.Random(seed)

    def ids(cache_blocks: int) -> list[int]:
        runs = list(range(0, cache_blocks, 4))
        rng.shuffle(runs)
        chosen = []
        for start in runs:
            chosen.extend(range(start, start + rng.randint(1, 4)))
            if len(chosen) >= NUM_TRANSFER_BLOCKS:
                return chosen[:NUM_TRANSFER_BLOCKS]
        raise AssertionError("cache too small for the transfer")

    return ids(LOCAL_CACHE_BLOCKS), ids(REMOTE_CACHE_BLOCKS)


def loop_plan(
    geometry: LayerGeometry, local_ids: list[int], remote_ids: list[int], remote_num_blocks: int
):
    """The baseline: the same arithmetic and merging, one block at a time in Python."""
    ratio = geometry.kernel_blocks_per_block
    element = geometry.element_size
    step = geometry.block_stride * element
    size = geometry.piece_bytes
    local_kv = geometry.kv_stride * element
    remote_kv = geometry.remote_kv_stride(remote_num_blocks) * element
    k_ranges, v_ranges = [], []
    for local_block, remote_block in zip(local_ids, remote_ids):
        for part in range(ratio):
            local_offset = (local_block * ratio + part) * step
            remote_offset = (remote_block * ratio + part) * step
            k_ranges.append((local_offset, remote_offset))
            if geometry.layout is KVLayout.INTERLEAVED:
                k_ranges.append((local_offset + local_kv, remote_offset + remote_kv))
            elif geometry.layout is KVLayout.SEPARATED:
                v_ranges.append((local_offset + local_kv, remote_offset + remote_kv))
    local_offsets, remote_offsets, sizes = [], [], []
    for local_offset, remote_offset in k_ranges + v_ranges:
        if (
            sizes
            and local_offsets[-1] + sizes[-1] == local_offset
            and remote_offsets[-1] + sizes[-1] == remote_offset
        ):
            sizes[-1] += size
        else:
            local_offsets.append(local_offset)
            remote_offsets.append(remote_offset)
            sizes.append(size)
    return local_offsets, remote_offsets, sizes


def time_once(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    layers = build_model()
    local_ids, remote_ids = block_mapping()

    def project():
        # Id lists become tensors once per transfer, then every layer is planned and
        # turned into the Python lists the engine's batch call receives, as the
        # baseline's lists are.
        local, remote = as_block_ids(local_ids), as_block_ids(remote_ids)
        return [
            plan_transfer(
                describe_layer(name, tensor, kv_format), local, remote, REMOTE_CACHE_BLOCKS
            ).lists
            for name, tensor, kv_format in layers
        ]

    def project_plans_only():
        # The same planning without the conversion to Python lists: reported for
        # information, to show how much of the project's time is the list boundary.
        local, remote = as_block_ids(local_ids), as_block_ids(remote_ids)
        return [
            plan_transfer(
                describe_layer(name, tensor, kv_format), local, remote, REMOTE_CACHE_BLOCKS
            )
            for name, tensor, kv_format in layers
        ]

    def baseline():
        return [
            loop_plan(
                describe_layer(name, tensor, kv_format), local_ids, remote_ids, REMOTE_CACHE_BLOCKS
            )
            for name, tensor, kv_format in layers
        ]

    for vectorized, looped in zip(project(), baseline()):
        assert vectorized == looped, "vectorized and looped plans differ"

    project_times, baseline_times, plans_only_times = [], [], []
    for _ in range(ROUNDS):
        project_times.append(time_once(project))
        baseline_times.append(time_once(baseline))
        plans_only_times.append(time_once(project_plans_only))

    # Misses: fresh planners (one per lookup, built outside the timed region) each
    # compute a plan; hits: one planner answers a layer whose geometry it has seen.
    name, tensor, kv_format = layers[0]
    local, remote = as_block_ids(local_ids), as_block_ids(remote_ids)
    miss_times, hit_times = [], []
    for _ in range(ROUNDS):
        fresh = [
            TransferPlanner(local, remote, REMOTE_CACHE_BLOCKS) for _ in range(LOOKUPS_PER_ROUND)
        ]

        def misses():
            for planner in fresh:  # noqa: B023 (called within this iteration)
                planner.plan(name, tensor, kv_format)

        warm = TransferPlanner(local, remote, REMOTE_CACHE_BLOCKS)
        warm.plan(name, tensor, kv_format)

        def hits():
            for _ in range(LOOKUPS_PER_ROUND):
                warm.plan(name, tensor, kv_format)  # noqa: B023 (called within this iteration)

        miss_times.append(time_once(misses) / LOOKUPS_PER_ROUND)
        hit_times.append(time_once(hits) / LOOKUPS_PER_ROUND)
        assert all(planner.misses == 1 for planner in fresh) and warm.hits == LOOKUPS_PER_ROUND

    project_time, baseline_time = (
        statistics.median(project_times),
        statistics.median(baseline_times),
    )
    miss_time, hit_time = statistics.median(miss_times), statistics.median(hit_times)
    print(f"layers={NUM_LAYERS} blocks={NUM_TRANSFER_BLOCKS} rounds={ROUNDS}")
    print(
        f"project: {project_time * 1e3:.2f} ms per model, per-block loop: {baseline_time * 1e3:.2f} ms per model"
    )
    print(
        f"project without the list conversion: {statistics.median(plans_only_times) * 1e3:.2f} ms "
        f"per model (speedup {baseline_time / statistics.median(plans_only_times):.1f}, for information)"
    )
    print(f"plan cache miss: {miss_time * 1e6:.1f} us, hit: {hit_time * 1e6:.2f} us")
    print(f"vectorized_speedup: {baseline_time / project_time:.1f}")
    print(f"cache_hit_speedup: {miss_time / hit_time:.1f}")


if __name__ == "__main__":
    main()
