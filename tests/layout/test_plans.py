"""Transfer plans checked against the tensors themselves.

The oracle is torch's own indexing: a block's K (V, latent) slice view, whose
``data_ptr()`` distance from the tensor's start is the byte offset a plan must name.
Copy tests move bytes with a plan and compare the blocks that land on the other side.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_fsm.layout import (
    KVLayout,
    LayerKVFormat,
    TransferPlanner,
    describe_layer,
    merge_ranges,
    plan_layer,
    registration_region,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

# Arrangements of one layer's cache. "on_hnd_storage" is vLLM's trick of a logical
# [.., B, H, D] shape over memory ordered [.., H, B, D]; "on_interleaved_storage" is a
# separated-looking shape whose strides put each block's K and V side by side.
ARRANGEMENTS = [
    "separated_nhd",
    "separated_hnd",
    "separated_nhd_on_hnd_storage",
    "separated_on_interleaved_storage",
    "interleaved_nhd",
    "interleaved_hnd",
    "mla",
]


def build_cache(
    arrangement, num_blocks, dtype, *, block_size=8, kernel_ratio=1, heads=2, head_size=4, latent=6
):
    """A layer cache of ``num_blocks`` scheduler blocks and the format describing it."""
    tokens = block_size // kernel_ratio
    physical = num_blocks * kernel_ratio
    shapes = {
        "separated_nhd": lambda: torch.empty(2, physical, tokens, heads, head_size, dtype=dtype),
        "separated_hnd": lambda: torch.empty(2, physical, heads, tokens, head_size, dtype=dtype),
        "separated_nhd_on_hnd_storage": lambda: torch.empty(
            2, physical, heads, tokens, head_size, dtype=dtype
        ).permute(0, 1, 3, 2, 4),
        "separated_on_interleaved_storage": lambda: torch.empty(
            physical, 2, tokens, heads, head_size, dtype=dtype
        ).transpose(0, 1),
        "interleaved_nhd": lambda: torch.empty(physical, 2, tokens, heads, head_size, dtype=dtype),
        "interleaved_hnd": lambda: torch.empty(physical, 2, heads, tokens, head_size, dtype=dtype),
        "mla": lambda: torch.empty(physical, tokens, latent, dtype=dtype),
    }
    tensor = shapes[arrangement]()
    if arrangement == "mla":
        return tensor, LayerKVFormat(block_size=block_size, head_size=latent, use_mla=True)
    kv_axis = 1 if arrangement.startswith("interleaved") else 0
    # Two physical blocks make [2, 2, ...]: only the format can say which axis is K/V.
    hint = kv_axis if tensor.shape[0] == tensor.shape[1] == 2 else None
    return tensor, LayerKVFormat(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, kv_axis=hint
    )


def pieces(tensor, arrangement, physical_block):
    """The K and V (or latent) slice views of one physical block."""
    if arrangement == "mla":
        return [tensor[physical_block]]
    if arrangement.startswith("interleaved"):
        return [tensor[physical_block, 0], tensor[physical_block, 1]]
    return [tensor[0, physical_block], tensor[1, physical_block]]


def byte_offset(tensor, view):
    return view.data_ptr() - tensor.data_ptr()


def oracle_ranges(local, remote, arrangement, local_ids, remote_ids, kernel_ratio):
    """Sorted (local offset, remote offset, size) of every piece, read from the tensors."""
    ranges = []
    for local_block, remote_block in zip(local_ids, remote_ids):
        for part in range(kernel_ratio):
            local_pieces = pieces(local, arrangement, local_block * kernel_ratio + part)
            remote_pieces = pieces(remote, arrangement, remote_block * kernel_ratio + part)
            for local_view, remote_view in zip(local_pieces, remote_pieces):
                ranges.append(
                    (
                        byte_offset(local, local_view),
                        byte_offset(remote, remote_view),
                        local_view.numel() * local.element_size(),
                    )
                )
    return sorted(ranges)


def plan_ranges(plan):
    return sorted(zip(*plan.lists))


def expand(plan):
    """Every (local byte, remote byte) pair a plan moves, in plan order."""
    sizes = plan.sizes
    starts = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    within = torch.arange(int(sizes.sum())) - starts
    local = torch.repeat_interleave(plan.local_offsets, sizes) + within
    remote = torch.repeat_interleave(plan.remote_offsets, sizes) + within
    return local, remote


def fill(tensor, seed):
    generator = torch.Generator().manual_seed(seed)
    tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    return tensor


def apply_plan(plan, source, source_spec, target, target_spec):
    """Copy bytes as an RDMA engine would, refusing any range outside either region."""
    source_bytes = registration_region("source", source, source_spec).byte_view(source)
    target_bytes = registration_region("target", target, target_spec).byte_view(target)
    for local, remote, size in zip(*plan.lists):
        assert 0 <= local and local + size <= source_bytes.numel(), "range leaves the source region"
        assert 0 <= remote and remote + size <= target_bytes.numel(), (
            "range leaves the target region"
        )
        target_bytes[remote : remote + size] = source_bytes[local : local + size]


def block_data(tensor, arrangement, block, kernel_ratio):
    span = slice(block * kernel_ratio, (block + 1) * kernel_ratio)
    data = (
        tensor[span]
        if arrangement in ("mla",) or arrangement.startswith("interleaved")
        else tensor[:, span]
    )
    # Compare bit patterns: 8-bit float types lack some comparison kernels on the CPU.
    return data.view(torch.uint8) if data.element_size() == 1 else data


def random_mapping(rng, local_blocks, remote_blocks, count):
    return rng.sample(range(local_blocks), count), rng.sample(range(remote_blocks), count)


# --- worked example and orders ----------------------------------------------------


def test_reference_worked_example_separated_bf16():
    tensor = torch.empty(2, 8, 4, 2, 3, dtype=torch.bfloat16)
    kv_format = LayerKVFormat(block_size=4, num_kv_heads=2, head_size=3)
    plan = plan_layer(
        "layers.0", tensor, kv_format, [1, 3], [4, 5], remote_num_blocks=16, merge=False
    )
    assert plan.lists == ([48, 144, 432, 528], [192, 240, 960, 1008], [48, 48, 48, 48])


def test_contiguous_runs_merge_and_others_stay_apart():
    tensor = torch.empty(2, 8, 4, 2, 3, dtype=torch.bfloat16)
    kv_format = LayerKVFormat(block_size=4, num_kv_heads=2, head_size=3)
    # Blocks 1,2 -> 4,5 are adjacent on both sides; 5 -> 9 is not adjacent remotely.
    plan = plan_layer("layers.0", tensor, kv_format, [1, 2, 3], [4, 5, 9], remote_num_blocks=16)
    assert plan.lists == ([48, 144, 432, 528], [192, 432, 960, 1200], [96, 48, 96, 48])
    assert plan.total_bytes == 6 * 48


def test_interleaved_blocks_merge_k_and_v_into_one_range_per_block():
    tensor = torch.empty(6, 2, 4, 2, 3, dtype=torch.float16)
    kv_format = LayerKVFormat(block_size=4, num_kv_heads=2, head_size=3)
    plan = plan_layer("layers.0", tensor, kv_format, [0, 4], [3, 1], remote_num_blocks=5)
    assert plan.lists == ([0, 4 * 96], [3 * 96, 96], [96, 96])


def test_interleaved_kernel_blocks_form_one_chunk_per_scheduler_block():
    tensor, kv_format = build_cache(
        "interleaved_hnd", 4, torch.float16, block_size=8, kernel_ratio=4
    )
    plan = plan_layer("layers.0", tensor, kv_format, [2, 0], [1, 3], remote_num_blocks=6)
    chunk = 4 * tensor.stride(0) * tensor.element_size()
    assert plan.lists == ([2 * chunk, 0], [chunk, 3 * chunk], [chunk, chunk])


def test_a_transfer_without_blocks_moves_nothing():
    tensor, kv_format = build_cache("separated_nhd", 4, torch.float16)
    plan = plan_layer("layers.0", tensor, kv_format, [], [], remote_num_blocks=4)
    assert len(plan) == 0 and plan.total_bytes == 0 and plan.lists == ([], [], [])


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("kernel_ratio", [1, 4])
def test_detected_family_follows_the_strides(arrangement, kernel_ratio):
    # three heads: never equal to a kernel block size, so the axis order is observable
    tensor, kv_format = build_cache(
        arrangement, 5, torch.float16, kernel_ratio=kernel_ratio, heads=3
    )
    geometry = describe_layer("layers.3", tensor, kv_format)
    expected = {
        "mla": KVLayout.MLA,
        "separated_on_interleaved_storage": KVLayout.INTERLEAVED,
    }.get(
        arrangement,
        KVLayout.INTERLEAVED if arrangement.startswith("interleaved") else KVLayout.SEPARATED,
    )
    assert geometry.layout is expected
    assert geometry.kernel_blocks_per_block == kernel_ratio
    assert geometry.num_blocks == 5
    if arrangement != "mla":
        assert geometry.axis_order == ("HND" if arrangement.endswith("hnd") else "NHD")


# --- oracle -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
@pytest.mark.parametrize("kernel_ratio", [1, 2, 4])
def test_every_offset_matches_the_tensor(arrangement, dtype, kernel_ratio):
    rng = random.Random(f"{arrangement}-{dtype}-{kernel_ratio}")
    local, kv_format = build_cache(arrangement, 9, dtype, kernel_ratio=kernel_ratio)
    remote, _ = build_cache(arrangement, 13, dtype, kernel_ratio=kernel_ratio)
    local_ids, remote_ids = random_mapping(rng, 9, 13, 6)
    plan = plan_layer(
        "layers.7", local, kv_format, local_ids, remote_ids, remote_num_blocks=13, merge=False
    )
    assert plan_ranges(plan) == oracle_ranges(
        local, remote, arrangement, local_ids, remote_ids, kernel_ratio
    )


# --- copy across caches of different size -----------------------------------------

MIXED_MODEL = [
    ("model.layers.0.attn", "separated_nhd", 1, torch.float16),
    ("model.layers.1.attn", "separated_nhd_on_hnd_storage", 1, torch.bfloat16),
    ("model.layers.2.attn", "interleaved_hnd", 1, torch.float16),
    ("model.layers.3.attn", "separated_hnd", 4, torch.float16),
    ("model.layers.4.attn", "interleaved_nhd", 2, torch.bfloat16),
    ("model.layers.5.attn", "mla", 1, torch.float16),
    ("model.layers.5.indexer", "mla", 2, torch.float32),
    ("model.layers.6.attn", "separated_nhd", 1, torch.float16),
]


def test_copy_moves_every_mapped_block_of_a_mixed_model():
    rng = random.Random(7)
    prefill_blocks, decode_blocks = 11, 17
    local_ids, remote_ids = random_mapping(rng, prefill_blocks, decode_blocks, 7)
    planner = TransferPlanner(local_ids, remote_ids, remote_num_blocks=decode_blocks)
    for index, (name, arrangement, ratio, dtype) in enumerate(MIXED_MODEL):
        prefill, kv_format = build_cache(arrangement, prefill_blocks, dtype, kernel_ratio=ratio)
        decode, decode_kv_format = build_cache(
            arrangement, decode_blocks, dtype, kernel_ratio=ratio
        )
        fill(prefill, seed=index)
        fill(decode, seed=100 + index)
        decode_before = decode.clone()
        apply_plan(
            planner.plan(name, prefill, kv_format), prefill, kv_format, decode, decode_kv_format
        )
        for local_block, remote_block in zip(local_ids, remote_ids):
            assert torch.equal(
                block_data(decode, arrangement, remote_block, ratio),
                block_data(prefill, arrangement, local_block, ratio),
            ), f"{name}: decode block {remote_block} differs from prefill block {local_block}"
        for untouched in set(range(decode_blocks)) - set(remote_ids):
            assert torch.equal(
                block_data(decode, arrangement, untouched, ratio),
                block_data(decode_before, arrangement, untouched, ratio),
            ), f"{name}: decode block {untouched} was written but is not in the mapping"
    # layers 0 and 6 have equal geometry and share a plan; the rest each needed their own
    assert (planner.misses, planner.hits) == (len(MIXED_MODEL) - 1, 1)


def test_dense_and_index_only_layers_of_one_request_get_their_own_plans():
    dense, dense_spec = build_cache("separated_nhd", 6, torch.bfloat16)
    index, index_spec = build_cache("mla", 6, torch.bfloat16, latent=3)
    planner = TransferPlanner([1, 2, 5], [0, 1, 2], remote_num_blocks=4)
    dense_plan = planner.plan("layers.0.attn", dense, dense_spec)
    index_plan = planner.plan("layers.0.indexer", index, index_spec)
    assert dense_plan is not index_plan
    assert dense_plan.lists != index_plan.lists
    assert planner.plan("layers.1.attn", dense.clone(), dense_spec) is dense_plan


def test_groups_with_equal_geometry_use_their_own_block_ids():
    tensor, kv_format = build_cache("interleaved_nhd", 8, torch.float16)
    planner = TransferPlanner([[0, 1], [5, 6]], [[2, 3], [0, 7]], remote_num_blocks=8)
    first = planner.plan("group0.layer", tensor, kv_format, group=0)
    second = planner.plan("group1.layer", tensor, kv_format, group=1)
    assert first.lists == plan_layer("x", tensor, kv_format, [0, 1], [2, 3], 8).lists
    assert second.lists == plan_layer("x", tensor, kv_format, [5, 6], [0, 7], 8).lists


def test_planner_keeps_at_most_max_plans_and_recomputes_evicted_ones():
    planner = TransferPlanner([0, 1], [1, 0], remote_num_blocks=3, max_plans=2)
    caches = [
        build_cache("separated_nhd", 3, dtype)
        for dtype in (torch.float16, torch.float32, torch.bfloat16)
    ]
    for index, (tensor, kv_format) in enumerate(caches):
        planner.plan(f"layers.{index}", tensor, kv_format)
    again = planner.plan("layers.0", *caches[0])
    assert planner.misses == 4 and planner.hits == 0
    assert again.lists == plan_layer("layers.0", *caches[0], [0, 1], [1, 0], 3).lists


def test_registration_region_aliases_the_cache_and_spans_it():
    tensor, kv_format = build_cache("separated_nhd", 5, torch.float16)
    region = registration_region("layers.0", tensor, kv_format)
    assert region.size_bytes == tensor.untyped_storage().nbytes()
    region.byte_view(tensor)[:2] = torch.tensor([0, 0x3C], dtype=torch.uint8)  # 1.0 in float16
    assert tensor[0, 0, 0, 0, 0].item() == 1.0


def test_remote_extent_matches_a_peer_cache_of_that_size():
    for arrangement in ARRANGEMENTS:
        local, kv_format = build_cache(arrangement, 5, torch.float16, kernel_ratio=2)
        remote, remote_kv_format = build_cache(arrangement, 9, torch.float16, kernel_ratio=2)
        assert (
            describe_layer("l", local, kv_format).extent_bytes(9)
            == registration_region("r", remote, remote_kv_format).size_bytes
        )


# --- properties -------------------------------------------------------------------


@st.composite
def scenarios(draw):
    arrangement = draw(st.sampled_from(ARRANGEMENTS))
    block_size = draw(st.sampled_from([4, 8, 16]))
    kernel_ratio = draw(st.sampled_from([1, 2, 4]))
    minimum_blocks = 2 if arrangement == "separated_on_interleaved_storage" else 1
    local_blocks = draw(st.integers(minimum_blocks, 7))
    remote_blocks = draw(st.integers(1, 9))
    count = draw(st.integers(0, min(local_blocks, remote_blocks)))
    local_ids = draw(st.permutations(range(local_blocks)))[:count]
    remote_ids = draw(st.permutations(range(remote_blocks)))[:count]
    # Sorted runs make merges likely, which is where off-by-one bugs would hide.
    if draw(st.booleans()):
        local_ids, remote_ids = sorted(local_ids), sorted(remote_ids)
    shape = dict(
        block_size=block_size,
        kernel_ratio=kernel_ratio,
        heads=draw(st.integers(1, 3)),
        head_size=draw(st.integers(1, 5)),
        latent=draw(st.integers(1, 9)),
    )
    dtype = draw(st.sampled_from(DTYPES))
    return arrangement, dtype, shape, local_blocks, remote_blocks, local_ids, remote_ids


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_property_plans_match_oracle_merge_losslessly_and_copy_exactly(scenario):
    arrangement, dtype, shape, local_blocks, remote_blocks, local_ids, remote_ids = scenario
    ratio = shape["kernel_ratio"]
    local, kv_format = build_cache(arrangement, local_blocks, dtype, **shape)
    remote, remote_kv_format = build_cache(arrangement, remote_blocks, dtype, **shape)

    unmerged = plan_layer(
        "layers.9", local, kv_format, local_ids, remote_ids, remote_blocks, merge=False
    )
    merged = plan_layer("layers.9", local, kv_format, local_ids, remote_ids, remote_blocks)
    assert plan_ranges(unmerged) == oracle_ranges(
        local, remote, arrangement, local_ids, remote_ids, ratio
    )

    # Merging moves exactly the same byte pairs, and leaves no mergeable neighbours.
    for merged_column, unmerged_column in zip(expand(merged), expand(unmerged)):
        assert torch.equal(merged_column, unmerged_column)
    ends = (
        merged.local_offsets[:-1] + merged.sizes[:-1],
        merged.remote_offsets[:-1] + merged.sizes[:-1],
    )
    assert not bool(
        ((merged.local_offsets[1:] == ends[0]) & (merged.remote_offsets[1:] == ends[1])).any()
    )

    fill(local, seed=1)
    fill(remote, seed=2)
    apply_plan(merged, local, kv_format, remote, remote_kv_format)
    for local_block, remote_block in zip(local_ids, remote_ids):
        assert torch.equal(
            block_data(remote, arrangement, remote_block, ratio),
            block_data(local, arrangement, local_block, ratio),
        )


# --- ownership ----------------------------------------------------------------------


def test_planner_keeps_its_own_copy_of_the_block_ids():
    dense, dense_spec = build_cache("separated_nhd", 6, torch.float16)
    index, index_spec = build_cache("mla", 6, torch.float16, latent=3)
    local, remote = torch.tensor([1, 2, 5]), torch.tensor([0, 1, 2])
    planner = TransferPlanner(local, remote, remote_num_blocks=4)
    planner.plan("layers.0.attn", dense, dense_spec)
    local[:] = torch.tensor([0, 0, 0])  # the caller reuses its buffer for the next request
    remote[:] = torch.tensor([3, 3, 3])
    assert (
        planner.plan("layers.0.indexer", index, index_spec).lists
        == plan_layer("x", index, index_spec, [1, 2, 5], [0, 1, 2], 4).lists
    )


def test_shared_plans_cannot_be_changed_through_their_lists_or_tensors():
    tensor, kv_format = build_cache("separated_nhd", 6, torch.float16)
    planner = TransferPlanner([1, 3], [0, 2], remote_num_blocks=4)
    plan = planner.plan("layers.0", tensor, kv_format)
    expected = plan_layer("x", tensor, kv_format, [1, 3], [0, 2], 4).lists
    local, remote, sizes = plan.lists
    local[0] = -1
    remote.append(7)
    sizes.clear()
    with pytest.raises(RuntimeError):
        plan.local_offsets.add_(1)
    with pytest.raises(RuntimeError):
        plan.sizes[0] = 0
    shared = planner.plan("layers.1", tensor.clone(), kv_format)
    assert shared is plan and shared.lists == expected


def test_separated_k_half_running_on_into_the_v_half_merges_across():
    tensor, kv_format = build_cache("separated_nhd", 3, torch.float16)
    merged = plan_layer("l", tensor, kv_format, [0, 2], [0, 3], remote_num_blocks=4)
    fine = plan_layer("l", tensor, kv_format, [0, 2], [0, 3], remote_num_blocks=4, merge=False)
    assert merged.lists == merge_ranges(fine.local_offsets, fine.remote_offsets, fine.sizes).lists
    assert len(merged) == 3  # K of block 0, K of block 2 + V of block 0, V of block 2
