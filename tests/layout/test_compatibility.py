"""check_compatible: two peers' KV caches, summarised from real tensors, must match in all a block's bytes depend on.

Each refusal names the field and both sides' values; the block count may differ; a summary survives the
handshake's wire map (the zmq codec's ``kv_format`` field) unchanged.
"""

from __future__ import annotations

import pytest
import torch

from moriio_fsm.layout import (
    CPU_ATTN,
    KVCacheSummary,
    KVIncompatibleError,
    KVLayoutError,
    LayerKVFormat,
    check_compatible,
    describe_layer,
)


def cpu_summary(
    num_blocks=8, dtype=torch.bfloat16, heads=2, block_size=32, head_size=16, scheduler_block=None
):
    cache = torch.empty(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)
    kv_format = LayerKVFormat(
        block_size=scheduler_block or block_size,
        num_kv_heads=heads,
        head_size=head_size,
        attention_backend=CPU_ATTN,
    )
    return KVCacheSummary.of(describe_layer("layers.0", cache, kv_format))


def separated_summary(heads=2, block_size=32, head_size=16):
    cache = torch.empty(2, 8, block_size, heads, head_size, dtype=torch.bfloat16)
    return KVCacheSummary.of(
        describe_layer("layers.0", cache, LayerKVFormat(block_size, heads, head_size))
    )


def test_peers_with_equal_geometry_and_different_block_counts_are_compatible():
    check_compatible(cpu_summary(num_blocks=8), cpu_summary(num_blocks=100))


def test_the_summary_reads_heads_and_head_size_off_the_tensor():
    summary = cpu_summary(heads=4, block_size=64, head_size=32)
    assert (summary.layout, summary.axis_order, summary.num_kv_heads, summary.head_size) == (
        "cpu_attn",
        "HND",
        4,
        32,
    )
    assert (summary.block_size, summary.kernel_block_size, summary.dtype) == (64, 64, "bfloat16")
    hnd = torch.empty(2, 8, 4, 32, 16, dtype=torch.float16)
    gpu = KVCacheSummary.of(
        describe_layer("l", hnd, LayerKVFormat(32, num_kv_heads=4, head_size=16))
    )
    assert (gpu.layout, gpu.axis_order, gpu.num_kv_heads, gpu.head_size) == (
        "separated",
        "HND",
        4,
        16,
    )
    mla = KVCacheSummary.of(
        describe_layer("l", torch.empty(8, 32, 576), LayerKVFormat(32, use_mla=True))
    )
    assert mla.num_kv_heads is None and mla.head_size == 576 and "num_kv_heads" not in mla.to_wire()


@pytest.mark.parametrize(
    "remote, named",
    [
        (cpu_summary(dtype=torch.float16), "dtype: local bfloat16, remote float16"),
        (cpu_summary(block_size=64), "block_size: local 32, remote 64"),
        (cpu_summary(heads=4), "num_kv_heads: local 2, remote 4"),
        (cpu_summary(head_size=32), "head_size: local 16, remote 32"),
        (separated_summary(), "layout: local cpu_attn, remote separated"),
        (
            cpu_summary(block_size=32, num_blocks=16, scheduler_block=64),
            "block_size: local 32, remote 64",
        ),
    ],
)
def test_each_difference_is_refused_naming_both_sides(remote, named):
    with pytest.raises(KVIncompatibleError, match=named):
        check_compatible(cpu_summary(), remote, layer_name="layers.7")


def test_every_difference_is_named_at_once_with_the_layer():
    with pytest.raises(KVIncompatibleError) as refused:
        check_compatible(
            cpu_summary(),
            cpu_summary(dtype=torch.float32, heads=1, head_size=64),
            layer_name="layers.7",
        )
    message = str(refused.value)
    assert message.startswith("layer 'layers.7': the peers' KV caches differ")
    for named in (
        "dtype: local bfloat16, remote float32",
        "num_kv_heads: local 2, remote 1",
        "head_size: local 16, remote 64",
    ):
        assert named in message


def test_kernel_block_size_differs_even_when_scheduler_blocks_match():
    with pytest.raises(KVIncompatibleError, match="kernel_block_size: local 64, remote 32"):
        check_compatible(
            cpu_summary(block_size=64),
            cpu_summary(block_size=32, num_blocks=16, scheduler_block=64),
        )


def test_only_summaries_are_compared():
    with pytest.raises(TypeError, match="remote must be a KVCacheSummary"):
        check_compatible(cpu_summary(), cpu_summary().to_wire())


def test_a_summary_survives_the_handshake_wire_map():
    from moriio_fsm.adapters.zmq import (
        AgentMetadata,
        HandshakeReply,
        decode_handshake_reply,
        encode_handshake_reply,
    )

    for summary in (
        cpu_summary(),
        separated_summary(),
        KVCacheSummary.of(
            describe_layer("l", torch.empty(4, 16, 64), LayerKVFormat(16, use_mla=True))
        ),
    ):
        meta = AgentMetadata(
            "P", b"desc", (4096,), 16, 512, "CPU_ATTN", kv_format=summary.to_wire()
        )
        decoded = decode_handshake_reply(
            *encode_handshake_reply(HandshakeReply(meta, {"layers.0": (b"m",)}))
        )
        assert KVCacheSummary.from_wire(decoded.metadata.kv_format) == summary


@pytest.mark.parametrize(
    "change, named",
    [
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"head_size": True}, "head_size must be a positive integer"),
        ({"dtype": "floaty"}, "dtype 'floaty' is not a torch dtype"),
        ({"layout": "cpu_blocks"}, "layout 'cpu_blocks' is none of"),
        ({"axis_order": "BHN"}, "axis_order 'BHN' is none of"),
        ({"extra": 1}, "unknown field"),
        ({"layout": "mla"}, "num_kv_heads must be given for every layout but mla"),
        ({"dtype": ""}, "dtype must be a non-empty string"),
    ],
)
def test_a_malformed_peer_summary_is_refused_naming_the_field(change, named):
    wire = {**cpu_summary().to_wire(), **change}
    with pytest.raises(KVLayoutError, match=named):
        KVCacheSummary.from_wire(wire)


def test_a_peer_summary_missing_a_field_is_refused():
    wire = cpu_summary().to_wire()
    del wire["block_size"]
    with pytest.raises(KVLayoutError, match="block_size must be a positive integer, got None"):
        KVCacheSummary.from_wire(wire)
    with pytest.raises(KVLayoutError, match="must be a map"):
        KVCacheSummary.from_wire([1, 2])
