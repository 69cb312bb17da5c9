"""Every shape, kv_format or block list the layout code refuses, and what the refusal says.

A refusal must name the layer and the shape and say what was expected, so that an
operator can fix the configuration from the message alone.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_fsm.layout import (
    KVLayout,
    KVLayoutError,
    LayerKVFormat,
    TransferPlanner,
    describe_layer,
    plan_layer,
    registration_region,
    registration_regions,
)

SPEC = LayerKVFormat(block_size=8, num_kv_heads=2, head_size=4)


def refusal(tensor, kv_format, layer="model.layers.4.self_attn"):
    with pytest.raises(KVLayoutError) as caught:
        describe_layer(layer, tensor, kv_format)
    message = str(caught.value)
    assert repr(layer) in message, message
    assert str(tuple(tensor.shape)) in message, message
    assert "expected" in message, message
    return message


def test_refusals_are_value_errors():
    assert issubclass(KVLayoutError, ValueError)


def test_unsupported_rank_lists_the_supported_layouts():
    message = refusal(torch.empty(4, 8, 2, 4), SPEC)
    assert "4 axes" in message and "[2, N, B, H, D]" in message and "[N, B, L]" in message


def test_five_axes_without_a_kv_axis_of_two():
    message = refusal(torch.empty(3, 4, 8, 2, 4), SPEC)
    assert "no K/V axis of size 2" in message


def test_both_leading_axes_two_is_ambiguous_without_kv_axis():
    message = refusal(torch.empty(2, 2, 8, 2, 4), SPEC)
    assert "ambiguous" in message and "kv_axis=0" in message and "kv_axis=1" in message
    # ...and the hint resolves it either way
    assert (
        describe_layer("l", torch.empty(2, 2, 8, 2, 4), LayerKVFormat(8, 2, 4, kv_axis=1)).kv_axis
        == 1
    )


def test_kv_axis_hint_that_does_not_have_size_two():
    message = refusal(torch.empty(2, 5, 8, 2, 4), LayerKVFormat(8, 2, 4, kv_axis=1))
    assert "kv_axis=1" in message and "size 2 on axis 1" in message


def test_kernel_block_axis_ambiguous_without_heads():
    # Axes 2 and 3 (4 and 2) both divide block_size 8: tokens could be either.
    message = refusal(torch.empty(2, 6, 4, 2, 16), LayerKVFormat(block_size=8))
    assert "ambiguous" in message and "num_kv_heads" in message


def test_without_heads_a_single_dividing_axis_is_read_as_the_block_axis():
    geometry = describe_layer("l", torch.empty(2, 6, 4, 3, 16), LayerKVFormat(block_size=8))
    assert geometry.kernel_blocks_per_block == 2 and geometry.token_axis == 2


def test_no_axis_divides_block_size_without_heads():
    message = refusal(torch.empty(2, 6, 3, 5, 16), LayerKVFormat(block_size=8))
    assert "divides block_size=8" in message


def test_heads_missing_from_the_shape():
    message = refusal(torch.empty(2, 6, 8, 3, 4), SPEC)
    assert "num_kv_heads=2" in message


def test_head_size_mismatch():
    message = refusal(torch.empty(2, 6, 8, 2, 5), SPEC)
    assert "head_size=4" in message and "last axis 5" in message


def test_block_axis_that_does_not_divide_block_size():
    message = refusal(torch.empty(2, 6, 3, 2, 4), SPEC)
    assert "3 tokens per block" in message and "does not divide block_size=8" in message


def test_physical_blocks_not_a_multiple_of_the_kernel_ratio():
    message = refusal(torch.empty(2, 7, 2, 2, 4), SPEC)
    assert "7 physical blocks" in message and "multiple of 4" in message


def test_three_axes_with_a_non_mla_spec():
    message = refusal(torch.empty(6, 8, 16), SPEC)
    assert "not MLA" in message and "use_mla=True" in message


def test_five_axes_with_an_mla_spec():
    message = refusal(torch.empty(2, 6, 8, 2, 4), LayerKVFormat(8, use_mla=True))
    assert "kv_format is MLA" in message


def test_block_data_split_by_strides():
    # Dropping one element of the head axis leaves holes inside every block.
    sliced = torch.empty(2, 6, 8, 2, 5)[..., :4]
    message = refusal(sliced, SPEC)
    assert "contiguous" in message and str(tuple(sliced.stride())) in message


def test_mla_block_data_split_by_strides():
    message = refusal(torch.empty(6, 8, 20)[:, :, :16], LayerKVFormat(8, use_mla=True))
    assert "contiguous" in message


def test_overlapping_blocks():
    base = torch.empty(4096)
    overlapping = base.as_strided((2, 6, 8, 2, 4), (64, 32, 8, 4, 1))
    assert "overlap" in refusal(overlapping, SPEC)
    overlapping_mla = base.as_strided((6, 8, 4), (16, 4, 1))
    assert "overlap" in refusal(overlapping_mla, LayerKVFormat(8, use_mla=True))


@pytest.mark.parametrize(
    "shape, kv_format",
    [
        ((2, 4, 0, 2, 3), LayerKVFormat(4)),
        ((2, 4, 2, 0, 3), LayerKVFormat(4)),
        ((2, 4, 4, 2, 0), LayerKVFormat(4, num_kv_heads=2)),
        ((4, 2, 0, 2, 3), LayerKVFormat(4, num_kv_heads=2)),
        ((4, 0, 3), LayerKVFormat(4, use_mla=True)),
        ((4, 4, 0), LayerKVFormat(4, use_mla=True)),
    ],
)
def test_empty_token_head_or_latent_axes_are_refused(shape, kv_format):
    assert "empty" in refusal(torch.empty(shape), kv_format)


def test_a_cache_without_blocks_is_described_and_plans_nothing():
    for shape, kv_format in [
        ((2, 0, 4, 2, 3), LayerKVFormat(4, 2)),
        ((0, 2, 4, 2, 3), LayerKVFormat(4, 2)),
        ((0, 4, 3), LayerKVFormat(4, use_mla=True)),
    ]:
        assert describe_layer("l", torch.empty(shape), kv_format).num_blocks == 0
        assert len(plan_layer("l", torch.empty(shape), kv_format, [], [], remote_num_blocks=0)) == 0


def test_unequal_block_lists_name_layer_shape_and_counts():
    tensor = torch.empty(2, 6, 8, 2, 4)
    with pytest.raises(KVLayoutError) as caught:
        plan_layer("model.layers.2.attn", tensor, SPEC, [0, 1, 2], [3, 4], remote_num_blocks=8)
    message = str(caught.value)
    assert "'model.layers.2.attn'" in message and "(2, 6, 8, 2, 4)" in message
    assert (
        "3 local block ids but 2 remote block ids" in message
        and "expected one remote block id per local" in message
    )


@pytest.mark.parametrize(
    "local_ids, remote_ids, phrase",
    [
        ([6], [0], "local block id 6 outside the local cache's 6 blocks"),
        ([-1], [0], "local block id -1"),
        ([0], [8], "remote block id 8 outside the remote cache's 8 blocks"),
    ],
)
def test_block_ids_out_of_range(local_ids, remote_ids, phrase):
    with pytest.raises(KVLayoutError) as caught:
        plan_layer(
            "layers.1", torch.empty(2, 6, 8, 2, 4), SPEC, local_ids, remote_ids, remote_num_blocks=8
        )
    assert phrase in str(caught.value) and "'layers.1'" in str(caught.value)


def id_refusal(local_ids, remote_ids, remote_num_blocks=8, layer="layers.3"):
    with pytest.raises(KVLayoutError) as caught:
        plan_layer(
            layer,
            torch.empty(2, 6, 8, 2, 4),
            SPEC,
            local_ids,
            remote_ids,
            remote_num_blocks=remote_num_blocks,
        )
    message = str(caught.value)
    assert repr(layer) in message and "(2, 6, 8, 2, 4)" in message and "expected" in message, (
        message
    )
    return message


@pytest.mark.parametrize(
    "local_ids, phrases",
    [
        ([1.7, 3.2], ["local block ids containing 1.7 (float)", "integer"]),
        ([1, 2.0], ["containing 2.0 (float)"]),
        ([True, False], ["containing True (bool)"]),
        (torch.tensor([1.0, 3.0]), ["local block ids of dtype torch.float32", "integer dtype"]),
        (torch.tensor([True, False]), ["local block ids of dtype torch.bool"]),
        ([2**70, 0], [f"containing {2**70}, which does not fit in int64", "in [0, 6)"]),
        (["1", "2"], ["containing '1' (str)"]),
    ],
)
def test_non_integer_block_ids_are_refused_not_truncated(local_ids, phrases):
    message = id_refusal(local_ids, [0, 1])
    for phrase in phrases:
        assert phrase in message, message


def test_non_integer_remote_ids_are_refused_too():
    assert "remote block ids of dtype torch.float64" in id_refusal(
        [0, 1], torch.tensor([0.0, 1.0], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    "count, phrase",
    [
        (16.5, "16.5 (float)"),
        (True, "True (bool)"),
        ("16", "'16' (str)"),
        (2**62, "beyond the int64 offsets"),
    ],
)
def test_non_integer_or_huge_remote_block_counts_are_refused(count, phrase):
    message = id_refusal([0], [0], remote_num_blocks=count)
    assert "remote_num_blocks" in message and phrase in message, message


def test_integer_like_ids_and_counts_are_accepted():
    numpy = pytest.importorskip("numpy")
    tensor = torch.empty(2, 6, 8, 2, 4)
    expected = plan_layer("l", tensor, SPEC, [1, 3], [0, 2], 4).lists
    for local, remote, count in [
        (torch.tensor([1, 3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.uint8), 4),
        (numpy.array([1, 3]), [numpy.int64(0), numpy.int32(2)], numpy.int64(4)),
        ([], [], 4),
    ]:
        plan = plan_layer("l", tensor, SPEC, local, remote, count)
        assert plan.lists == (expected if len(local) else ([], [], []))


def test_planner_refuses_bad_ids_and_counts_for_each_layer():
    cases = [
        (([0.5], [0], 4), "local block ids containing 0.5 (float)"),
        (([0], [torch.tensor(True)], 4), "remote block ids containing tensor(True) (Tensor)"),
        (([[0], [1.5]], [[0], [1]], 4), "local block ids containing 1.5 (float)"),
        (([0], [0], 4.0), "remote_num_blocks=4.0 (float)"),
    ]
    for args, phrase in cases:
        planner = TransferPlanner(*args)
        for layer in ("layers.0", "layers.1"):
            with pytest.raises(KVLayoutError) as caught:
                planner.plan(layer, torch.empty(2, 6, 8, 2, 4), SPEC, group=len(args[0]) - 1)
            message = str(caught.value)
            assert (
                f"'{layer}'" in message and "(2, 6, 8, 2, 4)" in message and "expected" in message
            )
            assert phrase in message, message


def test_kernel_blocks_bound_ids_by_scheduler_blocks():
    # 8 physical blocks of 2 tokens = 2 scheduler blocks of 8 tokens: id 2 is out of range.
    with pytest.raises(KVLayoutError, match="local block id 2 outside the local cache's 2 blocks"):
        plan_layer("layers.1", torch.empty(2, 8, 2, 2, 4), SPEC, [2], [0], remote_num_blocks=4)


def test_planner_reports_unequal_lists_for_the_layer_every_time():
    planner = TransferPlanner([0, 1], [0], remote_num_blocks=4)
    for _ in range(2):
        with pytest.raises(KVLayoutError, match="'layers.0'.*2 local block ids but 1 remote"):
            planner.plan("layers.0", torch.empty(2, 6, 8, 2, 4), SPEC)


def test_planner_refuses_mismatched_group_counts_and_unknown_groups():
    with pytest.raises(ValueError, match="2 local KV cache groups but 1 remote"):
        TransferPlanner([[0], [1]], [[0]], remote_num_blocks=4)
    planner = TransferPlanner([[0], [1]], [[0], [1]], remote_num_blocks=4)
    with pytest.raises(ValueError, match="'layers.0'.*group 2 is not in this transfer"):
        planner.plan("layers.0", torch.empty(2, 6, 8, 2, 4), SPEC, group=2)


@pytest.mark.parametrize(
    "fields, phrase",
    [
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(block_size=8, num_kv_heads=0), "num_kv_heads must be a positive int"),
        (dict(block_size=8, head_size=-3), "head_size must be a positive int"),
        (dict(block_size=8, kv_axis=2), "kv_axis must be 0, 1 or None"),
    ],
)
def test_spec_fields_out_of_range(fields, phrase):
    with pytest.raises(ValueError, match=phrase):
        LayerKVFormat(**fields)


def test_byte_view_refuses_a_tensor_of_another_geometry():
    tensor = torch.empty(2, 6, 8, 2, 4)
    region = registration_region("layers.0", tensor, SPEC)
    with pytest.raises(KVLayoutError, match="'layers.0'.*not the tensor this region was made for"):
        region.byte_view(torch.empty(2, 7, 8, 2, 4))


def test_registration_regions_name_a_layer_without_spec():
    with pytest.raises(KeyError, match="'layers.1' has a KV cache tensor but no LayerKVFormat"):
        registration_regions(
            {"layers.0": torch.empty(2, 6, 8, 2, 4), "layers.1": torch.empty(2, 6, 8, 2, 4)},
            {"layers.0": SPEC},
        )


@settings(max_examples=120, deadline=None)
@given(
    shape=st.one_of(
        st.lists(st.integers(0, 5), min_size=1, max_size=6),
        # near-miss variants of the real layouts, so that many shapes are accepted;
        # empty axes are drawn too, as an empty cache must be planned or refused cleanly
        st.tuples(st.just(2), *[st.integers(0, 5)] * 4),
        st.tuples(st.integers(0, 5), st.just(2), *[st.integers(0, 5)] * 3),
        st.tuples(*[st.integers(0, 5)] * 3),
    ),
    block_size=st.sampled_from([1, 2, 4, 8]),
    heads=st.one_of(st.none(), st.integers(1, 4)),
    spec_matches_rank=st.integers(0, 3),
)
def test_property_any_shape_is_planned_exactly_or_refused_with_layer_and_shape(
    shape, block_size, heads, spec_matches_rank
):
    shape = tuple(shape)
    tensor = torch.empty(shape, dtype=torch.float16)
    use_mla = (len(shape) == 3) == bool(spec_matches_rank)  # mostly the right kind of kv_format
    kv_format = LayerKVFormat(block_size=block_size, num_kv_heads=heads, use_mla=use_mla)
    try:
        geometry = describe_layer("layers.x", tensor, kv_format)
    except KVLayoutError as error:
        assert (
            "'layers.x'" in str(error)
            and str(tuple(shape)) in str(error)
            and "expected" in str(error)
        )
        return
    # Accepted: every physical block's K (or latent) piece must sit where torch's own
    # indexing puts it.
    physical = range(geometry.num_physical_blocks)
    ids = list(range(geometry.num_blocks))
    offsets = plan_layer(
        "layers.x", tensor, kv_format, ids, ids, geometry.num_blocks, merge=False
    ).local_offsets.tolist()
    if geometry.layout is KVLayout.INTERLEAVED:
        k_offsets = offsets[0::2]
    else:
        k_offsets = offsets[: len(physical)]
    if geometry.kv_axis is None:
        views = [tensor[p] for p in physical]
    elif geometry.kv_axis == 0:
        views = [tensor[0, p] for p in physical]
    else:
        views = [tensor[p, 0] for p in physical]
    assert k_offsets == [view.data_ptr() - tensor.data_ptr() for view in views]


def test_from_vllm_without_vllm_says_what_to_install():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed; the conversion itself is tested in test_vllm_format.py")
    with pytest.raises(ImportError, match="needs the vllm package"):
        LayerKVFormat.from_vllm(object())
