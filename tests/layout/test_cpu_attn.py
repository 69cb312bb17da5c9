"""The CPU attention backend's cache [num_blocks, num_kv_heads, block_size, 2*head_size], checked on real tensors.

The oracle is the tensor itself: the byte offset of block b is ``cache[b].data_ptr() - cache.data_ptr()``, and
bytes copied by a plan must reproduce each local block in its remote block and touch no other.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_fsm.layout import (
    CPU_ATTN,
    KVLayout,
    KVLayoutError,
    LayerKVFormat,
    TransferPlanner,
    describe_layer,
    plan_transfer,
    registration_region,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def cpu_format(block_size=32, heads=2, head_size=16, **extra) -> LayerKVFormat:
    return LayerKVFormat(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        attention_backend=CPU_ATTN,
        **extra,
    )


def cpu_cache(num_blocks, dtype=torch.bfloat16, heads=2, block_size=32, head_size=16, seed=0):
    values = torch.randn(
        num_blocks, heads, block_size, 2 * head_size, generator=torch.Generator().manual_seed(seed)
    )
    return values.to(dtype)


def byte_offset(cache: torch.Tensor, block: int) -> int:
    return cache[block].data_ptr() - cache.data_ptr()


def copy_by_plan(plan, local: torch.Tensor, remote: torch.Tensor) -> None:
    local_bytes = local.reshape(-1).view(torch.uint8)
    remote_bytes = remote.reshape(-1).view(torch.uint8)
    for lo, ro, size in zip(*plan.lists):
        remote_bytes[ro : ro + size] = local_bytes[lo : lo + size]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, block_size, head_size", [(1, 32, 32), (2, 32, 16), (4, 64, 8), (3, 32, 64)]
)
def test_block_offsets_and_length_are_the_tensors_own(dtype, heads, block_size, head_size):
    cache = cpu_cache(7, dtype, heads, block_size, head_size)
    geometry = describe_layer("layers.0", cache, cpu_format(block_size, heads, head_size))
    assert geometry.layout is KVLayout.CPU_ATTN and geometry.num_blocks == 7
    element = cache.element_size()
    assert geometry.block_bytes == heads * block_size * 2 * head_size * element
    assert geometry.block_stride * element == byte_offset(cache, 1)
    plan = plan_transfer(geometry, [0, 2, 6, 3], [1, 5, 0, 2], 9, merge=False)
    local, remote, sizes = plan.lists
    assert local == [byte_offset(cache, b) for b in (0, 2, 6, 3)]
    assert remote == [b * geometry.block_bytes for b in (1, 5, 0, 2)]
    assert sizes == [cache[0].numel() * element] * 4


def test_kernel_blocks_smaller_than_the_scheduler_block_move_together():
    # Scheduler blocks of 64 tokens kept by the kernel as two physical blocks of 32.
    cache = cpu_cache(8, block_size=32)
    geometry = describe_layer("layers.0", cache, cpu_format(block_size=64))
    assert geometry.kernel_blocks_per_block == 2 and geometry.num_blocks == 4
    plan = plan_transfer(geometry, [3, 1], [0, 2], 4)
    assert plan.lists == (
        [byte_offset(cache, 6), byte_offset(cache, 2)],
        [0, 2 * byte_offset(cache, 2)],
        [2 * byte_offset(cache, 1)] * 2,
    )


def test_a_layer_viewed_out_of_one_allocation_plans_from_its_own_first_byte():
    # vLLM's CPU layers are views into one allocation; offsets are from each view's start.
    allocation = torch.zeros(3, 5, 2, 32, 32, dtype=torch.float16)
    layer = allocation[1]
    geometry = describe_layer("layers.1", layer, cpu_format())
    plan = plan_transfer(geometry, [4], [0], 5)
    assert plan.lists[0] == [layer[4].data_ptr() - layer.data_ptr()]
    region = registration_region("layers.1", layer, cpu_format())
    view = region.byte_view(layer)
    assert (
        view.data_ptr() == layer.data_ptr() and view.numel() == layer.numel() * layer.element_size()
    )


def test_blocks_with_gaps_between_them_are_planned_by_their_stride_and_never_merged_across_a_gap():
    padded = cpu_cache(6, heads=3)[:, :2]  # each block followed by one unused head's worth of bytes
    geometry = describe_layer("layers.0", padded, cpu_format())
    assert geometry.block_stride > geometry.piece_elements
    plan = plan_transfer(geometry, [1, 2, 3], [1, 2, 3], 6)
    assert plan.lists[0] == [byte_offset(padded, b) for b in (1, 2, 3)]
    assert plan.lists[2] == [geometry.block_bytes] * 3


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    local_blocks=st.integers(1, 12),
    remote_blocks=st.integers(1, 12),
)
def test_copying_by_the_plan_puts_each_local_block_in_its_remote_block_and_touches_nothing_else(
    data, dtype, local_blocks, remote_blocks
):
    count = data.draw(st.integers(0, min(local_blocks, remote_blocks)))
    local_ids = data.draw(st.permutations(range(local_blocks)))[:count]
    remote_ids = data.draw(st.permutations(range(remote_blocks)))[:count]
    local = cpu_cache(local_blocks, dtype, seed=1)
    remote = torch.zeros(remote_blocks, 2, 32, 32, dtype=dtype)
    plan = plan_transfer(
        describe_layer("layers.0", local, cpu_format()), local_ids, remote_ids, remote_blocks
    )
    copy_by_plan(plan, local, remote)
    for local_id, remote_id in zip(local_ids, remote_ids):
        assert torch.equal(remote[remote_id].view(torch.uint8), local[local_id].view(torch.uint8))
    untouched = sorted(set(range(remote_blocks)) - set(remote_ids))
    assert all(int(remote[b].view(torch.uint8).count_nonzero()) == 0 for b in untouched)


def test_consecutive_blocks_on_both_sides_merge_into_one_range():
    cache = cpu_cache(8)
    plan = plan_transfer(
        describe_layer("layers.0", cache, cpu_format()), [2, 3, 4, 6], [0, 1, 2, 3], 8
    )
    block = byte_offset(cache, 1)
    assert plan.lists == ([2 * block, 6 * block], [0, 3 * block], [3 * block, block])


def test_the_planner_serves_cpu_layers_of_equal_geometry_one_plan():
    planner = TransferPlanner([0, 1], [5, 6], 8)
    first = planner.plan("layers.0", cpu_cache(4), cpu_format())
    assert planner.plan("layers.1", cpu_cache(4, seed=2), cpu_format()) is first
    assert planner.hits == 1


# -- refusals: never confused with another layout ----------------------------------------


def test_a_4d_cache_without_the_backend_named_is_refused_saying_what_to_set():
    with pytest.raises(KVLayoutError, match="4 axes.*attention_backend='CPU_ATTN'"):
        describe_layer(
            "layers.0", cpu_cache(4), LayerKVFormat(block_size=32, num_kv_heads=2, head_size=16)
        )
    with pytest.raises(KVLayoutError, match="4 axes"):
        describe_layer(
            "layers.0", cpu_cache(4), LayerKVFormat(block_size=32, attention_backend="FLASH_ATTN")
        )


def test_a_gpu_cache_described_as_cpu_attention_is_refused():
    gpu = torch.empty(2, 4, 32, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(
        KVLayoutError, match=r"5 axes but the kv_format is CPU_ATTN.*\[num_blocks, num_kv_heads"
    ):
        describe_layer("layers.0", gpu, cpu_format())
    # Any other backend name keeps the GPU layouts, read from the shape as before.
    geometry = describe_layer(
        "layers.0",
        gpu,
        LayerKVFormat(block_size=32, num_kv_heads=2, attention_backend="FLASH_ATTN"),
    )
    assert geometry.layout is KVLayout.SEPARATED


@pytest.mark.parametrize(
    "cache, kv_format, named",
    [
        (
            cpu_cache(4, heads=4),
            cpu_format(heads=2),
            "4 heads on axis 1, not the format's num_kv_heads=2",
        ),
        (cpu_cache(4, head_size=8), cpu_format(head_size=16), "last axis 16, not 2\\*head_size=32"),
        (torch.empty(4, 2, 32, 31), cpu_format(head_size=None), "odd last axis 31"),
        (cpu_cache(4, block_size=48), cpu_format(block_size=32), "48 tokens per block on axis 2"),
        (
            cpu_cache(3, block_size=32),
            cpu_format(block_size=64),
            "3 physical blocks, not a multiple of",
        ),
        (cpu_cache(4).transpose(1, 2), cpu_format(heads=32, block_size=2), "not one row-major"),
        (torch.empty(4, 0, 32, 32), cpu_format(heads=None), "empty axis 1"),
    ],
)
def test_caches_that_are_not_the_cpu_layout_are_refused_naming_layer_and_shape(
    cache, kv_format, named
):
    with pytest.raises(KVLayoutError, match=f"layer 'layers.3': KV cache of shape .*{named}"):
        describe_layer("layers.3", cache, kv_format)


def test_overlapping_blocks_are_refused():
    # Row-major blocks of 2048 elements placed 1024 apart.
    overlapping = torch.as_strided(torch.zeros(8192), (4, 2, 32, 32), (1024, 1024, 32, 1))
    with pytest.raises(
        KVLayoutError, match="block stride 1024 < block size 2048, so blocks overlap"
    ):
        describe_layer("layers.0", overlapping, cpu_format())


def test_a_cpu_format_cannot_also_be_mla_or_name_a_kv_axis():
    with pytest.raises(ValueError, match="cannot set use_mla or kv_axis"):
        cpu_format(use_mla=True)
    with pytest.raises(ValueError, match="cannot set use_mla or kv_axis"):
        cpu_format(kv_axis=0)
    with pytest.raises(ValueError, match="attention_backend must be a backend name"):
        LayerKVFormat(block_size=32, attention_backend="")


def test_the_format_without_heads_or_head_size_still_reads_the_shape():
    geometry = describe_layer(
        "layers.0",
        cpu_cache(4, heads=8, head_size=4),
        LayerKVFormat(block_size=32, attention_backend=CPU_ATTN),
    )
    assert geometry.block_bytes == 8 * 32 * 8 * 2
