"""Head-sliced plans: P ranks holding 1/k of the heads write into a D rank holding all of them.

The oracle is torch's indexing: after every P rank copied its blocks with its plan, each D block
must equal the P ranks' blocks concatenated along the heads axis, and every other D byte must be
untouched. Refusals are checked for the layouts a slice cannot be placed in exactly.
"""

from __future__ import annotations

import pytest
import torch

from moriio_fsm.layout import (
    CPU_ATTN,
    HeadSlice,
    KVCacheSummary,
    KVIncompatibleError,
    KVLayoutError,
    LayerKVFormat,
    TransferPlanner,
    check_compatible,
    describe_layer,
    plan_layer,
    plan_transfer,
    registration_region,
)

# name: (builder of a [blocks, heads] cache, the heads axis in the logical shape)
ARRANGEMENTS = {
    "separated_nhd": (lambda n, t, h, d: torch.empty(2, n, t, h, d), 3),
    "separated_hnd": (lambda n, t, h, d: torch.empty(2, n, h, t, d), 2),
    "separated_nhd_on_hnd_storage": (
        lambda n, t, h, d: torch.empty(2, n, h, t, d).permute(0, 1, 3, 2, 4),
        3,
    ),
    "separated_on_interleaved_storage": (
        lambda n, t, h, d: torch.empty(n, 2, t, h, d).transpose(0, 1),
        3,
    ),
    "interleaved_nhd": (lambda n, t, h, d: torch.empty(n, 2, t, h, d), 3),
    "interleaved_hnd": (lambda n, t, h, d: torch.empty(n, 2, h, t, d), 2),
    "cpu_attn": (lambda n, t, h, d: torch.empty(n, h, t, 2 * d), 1),
}
BLOCK_SIZE, HEAD_SIZE = 8, 4


def make_cache(arrangement, blocks, heads, *, kernel_ratio=1, dtype=torch.float32):
    build, _ = ARRANGEMENTS[arrangement]
    tokens = BLOCK_SIZE // kernel_ratio
    tensor = build(blocks * kernel_ratio, tokens, heads, HEAD_SIZE).to(dtype)
    backend = CPU_ATTN if arrangement == "cpu_attn" else None
    fmt = LayerKVFormat(
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_size=HEAD_SIZE,
        attention_backend=backend,
    )
    return tensor, fmt


def copy_with(plan, source: torch.Tensor, source_fmt, target: torch.Tensor, target_fmt) -> None:
    """Move the bytes a plan names from ``source``'s layer to ``target``'s, as an engine would."""
    src = registration_region("src", source, source_fmt).byte_view(source)
    dst = registration_region("dst", target, target_fmt).byte_view(target)
    local, remote, sizes = plan.lists
    for at, to, size in zip(local, remote, sizes):
        dst[to : to + size] = src[at : at + size]


def block_view(tensor: torch.Tensor, arrangement: str, block: int, kernel_ratio: int):
    """The scheduler block ``block`` of a cache, physical blocks stacked first."""
    physical = slice(block * kernel_ratio, (block + 1) * kernel_ratio)
    if arrangement.startswith("separated"):
        return tensor[:, physical]
    return tensor[physical]


def heads_of(view: torch.Tensor, arrangement: str, start: int, count: int) -> torch.Tensor:
    _, axis = ARRANGEMENTS[arrangement]  # a block view keeps every axis in its place
    return view.narrow(axis, start, count)


@pytest.mark.parametrize("arrangement", sorted(ARRANGEMENTS))
@pytest.mark.parametrize(("local_heads", "ratio"), [(1, 2), (2, 2), (1, 4)])
@pytest.mark.parametrize("kernel_ratio", [1, 2])
def test_every_p_rank_lands_in_its_heads_and_nothing_else_moves(
    arrangement, local_heads, ratio, kernel_ratio
):
    torch.manual_seed(0)
    d_blocks = 6
    remote, remote_fmt = make_cache(
        arrangement, d_blocks, local_heads * ratio, kernel_ratio=kernel_ratio
    )
    remote.fill_(-1.0)
    before = remote.clone()
    p_ids, d_ids = [3, 0, 1], [4, 1, 2]  # D's 1 and 2 consecutive, P's 0 and 1 too
    ranks = []
    for index in range(ratio):
        local, local_fmt = make_cache(arrangement, 4, local_heads, kernel_ratio=kernel_ratio)
        local.copy_(torch.randn(local.shape))
        plan = plan_layer(
            "layer.0", local, local_fmt, p_ids, d_ids, d_blocks, heads=HeadSlice(ratio, index)
        )
        copy_with(plan, local, local_fmt, remote, remote_fmt)
        ranks.append(local)
    for p_block, d_block in zip(p_ids, d_ids):
        landed = block_view(remote, arrangement, d_block, kernel_ratio)
        for index, local in enumerate(ranks):
            mine = block_view(local, arrangement, p_block, kernel_ratio)
            theirs = heads_of(landed, arrangement, index * local_heads, local_heads)
            assert torch.equal(theirs, mine), f"rank {index} block {p_block} -> {d_block}"
    untouched = [b for b in range(d_blocks) if b not in d_ids]
    for block in untouched:
        assert torch.equal(
            block_view(remote, arrangement, block, kernel_ratio),
            block_view(before, arrangement, block, kernel_ratio),
        )


def test_heads_outer_blocks_move_as_one_range_per_block_and_nhd_as_one_per_token():
    hnd, hnd_fmt = make_cache("cpu_attn", 4, 1)
    plan = plan_layer("l", hnd, hnd_fmt, [0, 1, 2], [0, 1, 2], 4, heads=HeadSlice(2, 1))
    block_bytes = 1 * BLOCK_SIZE * 2 * HEAD_SIZE * 4
    # P's blocks are contiguous but D's heads slices are not: nothing merges.
    assert plan.sizes.tolist() == [block_bytes] * 3
    assert plan.remote_offsets.tolist() == [block_bytes * (2 * block + 1) for block in range(3)]
    nhd, nhd_fmt = make_cache("interleaved_nhd", 4, 2)
    plan = plan_layer("l", nhd, nhd_fmt, [0], [0], 4, heads=HeadSlice(2, 0))
    # K and V of one block, one run of 2 heads x 4 elements per token.
    assert plan.sizes.tolist() == [2 * HEAD_SIZE * 4] * (2 * BLOCK_SIZE)


def test_ratio_one_is_the_plain_plan():
    local, fmt = make_cache("separated_hnd", 5, 2)
    plain = plan_layer("l", local, fmt, [0, 1, 4], [2, 3, 0], 5)
    sliced = plan_layer("l", local, fmt, [0, 1, 4], [2, 3, 0], 5, heads=HeadSlice(1, 0))
    assert plain.lists == sliced.lists


def test_the_planner_plans_every_layer_into_its_slice():
    local, fmt = make_cache("cpu_attn", 4, 1)
    planner = TransferPlanner([1, 2], [3, 0], 4, heads=HeadSlice(2, 1))
    plan = planner.plan("l", local, fmt)
    expected = plan_layer("l", local, fmt, [1, 2], [3, 0], 4, heads=HeadSlice(2, 1))
    assert plan.lists == expected.lists
    assert plan.lists != plan_layer("l", local, fmt, [1, 2], [3, 0], 4).lists


def test_an_mla_cache_is_refused_a_head_slice():
    latent = torch.empty(4, BLOCK_SIZE, 6)
    fmt = LayerKVFormat(block_size=BLOCK_SIZE, use_mla=True)
    with pytest.raises(KVLayoutError, match="layer 'mla'.*MLA.*no heads to split"):
        plan_layer("mla", latent, fmt, [0], [0], 4, heads=HeadSlice(2, 0))


def test_heads_innermost_storage_is_refused_naming_the_strides():
    # Logical [2, N, B, H, D] over memory [2, N, B, D, H]: a head's elements are strided.
    tensor = torch.empty(2, 4, BLOCK_SIZE, HEAD_SIZE, 2).transpose(3, 4)
    fmt = LayerKVFormat(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=HEAD_SIZE)
    describe_layer("odd", tensor, fmt)  # the plain plan moves its blocks whole
    with pytest.raises(KVLayoutError, match=r"layer 'odd'.*strides .*neither one run"):
        plan_layer("odd", tensor, fmt, [0], [0], 4, heads=HeadSlice(2, 0))


@pytest.mark.parametrize(
    ("ratio", "index"), [(2, 2), (2, -1), (0, 0), (True, 0), (2, 1.0), ("2", 0)]
)
def test_a_slice_outside_its_ratio_is_refused(ratio, index):
    with pytest.raises(ValueError, match="HeadSlice"):
        HeadSlice(ratio, index)


def test_heads_must_be_a_head_slice():
    local, fmt = make_cache("cpu_attn", 4, 1)
    geometry = describe_layer("l", local, fmt)
    with pytest.raises(TypeError, match="HeadSlice"):
        plan_transfer(geometry, [0], [0], 4, heads=(2, 1))  # type: ignore[arg-type]


def test_remote_ids_are_checked_against_the_remote_block_count():
    local, fmt = make_cache("cpu_attn", 8, 1)
    with pytest.raises(KVLayoutError, match="remote block id 4 outside the remote cache's 4"):
        plan_layer("l", local, fmt, [5], [4], 4, heads=HeadSlice(2, 0))


def test_a_remote_count_whose_bigger_blocks_overflow_the_offsets_is_refused():
    local, fmt = make_cache("cpu_attn", 2, 1)
    block_bytes = BLOCK_SIZE * 2 * HEAD_SIZE * 4
    fits_alone = (2**63 - 1) // block_bytes  # fits with our heads, not with 4x them
    plan_layer("l", local, fmt, [0], [0], fits_alone)
    with pytest.raises(KVLayoutError, match="beyond the int64 offsets"):
        plan_layer("l", local, fmt, [0], [0], fits_alone, heads=HeadSlice(4, 3))


def test_of_rank_gives_each_p_rank_its_slice_of_a_smaller_d():
    assert [HeadSlice.of_rank(rank, 4, 2) for rank in range(4)] == [
        HeadSlice(2, 0),
        HeadSlice(2, 1),
        HeadSlice(2, 0),
        HeadSlice(2, 1),
    ]
    assert HeadSlice.of_rank(0, 2, 2) is None  # equal sizes: whole blocks
    assert HeadSlice.of_rank(0, 1, 2) is None  # D larger: not a head slice of ours
    assert HeadSlice.of_rank(0, 3, 2) is None  # no whole ratio


# -- the handshake's check ------------------------------------------------------------------


def summary(heads: int | None, **changes) -> KVCacheSummary:
    values = dict(
        layout="cpu_attn",
        axis_order="HND",
        dtype="bfloat16",
        block_size=128,
        kernel_block_size=128,
        num_kv_heads=heads,
        head_size=32,
    )
    values.update(changes)
    return KVCacheSummary(**values)


def test_the_handshake_accepts_exactly_ratio_times_the_heads():
    check_compatible(summary(1), summary(2), head_ratio=2)
    check_compatible(summary(2), summary(8), head_ratio=4)


@pytest.mark.parametrize(("mine", "theirs", "ratio"), [(1, 1, 2), (1, 4, 2), (2, 2, 2), (2, 1, 1)])
def test_the_handshake_refuses_any_other_head_count(mine, theirs, ratio):
    with pytest.raises(KVIncompatibleError, match=f"num_kv_heads: local {mine}, remote {theirs}"):
        check_compatible(summary(mine), summary(theirs), head_ratio=ratio)


def test_the_handshake_still_names_every_other_difference_with_a_head_ratio():
    with pytest.raises(KVIncompatibleError) as refused:
        check_compatible(summary(1), summary(2, block_size=64, dtype="float16"), head_ratio=2)
    message = str(refused.value)
    assert "block_size: local 128, remote 64" in message
    assert "dtype: local bfloat16, remote float16" in message
    assert "num_kv_heads" not in message


def test_the_handshake_refuses_a_head_ratio_for_mla():
    mla = summary(None, layout="mla", axis_order="NL")
    with pytest.raises(KVIncompatibleError, match="an MLA cache has none"):
        check_compatible(mla, mla, head_ratio=2)


@pytest.mark.parametrize("ratio", [0, -2, True, 1.5])
def test_a_head_ratio_that_is_no_positive_int_is_refused(ratio):
    with pytest.raises(ValueError, match="head_ratio"):
        check_compatible(summary(1), summary(2), head_ratio=ratio)
