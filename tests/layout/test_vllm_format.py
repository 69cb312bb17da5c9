"""``LayerKVFormat.from_vllm`` against the real vLLM kv_format classes.

Rules: only vLLM's own kv_format objects are used (no stand-ins), so the module is skipped
when vLLM is not installed; each converted kv_format must describe a cache of vLLM's shape.
"""

from __future__ import annotations

import pytest
import torch

from moriio_fsm.layout import LayerKVFormat, describe_layer

kv_cache_interface = pytest.importorskip(
    "vllm.v1.kv_cache_interface", reason="vLLM is not installed; LayerKVFormat.from_vllm needs it"
)


def test_full_attention_spec_becomes_a_kv_spec():
    vllm_spec = kv_cache_interface.FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.float16
    )
    kv_format = LayerKVFormat.from_vllm(vllm_spec)
    assert kv_format == LayerKVFormat(block_size=16, num_kv_heads=8, head_size=128, use_mla=False)
    assert (
        describe_layer(
            "layers.0", torch.empty(2, 4, 16, 8, 128, device="meta"), kv_format
        ).num_blocks
        == 4
    )


def test_mla_attention_spec_becomes_an_mla_spec():
    vllm_spec = kv_cache_interface.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )
    kv_format = LayerKVFormat.from_vllm(vllm_spec)
    assert kv_format.use_mla and kv_format.block_size == 64
    assert (
        describe_layer("layers.0", torch.empty(3, 64, 576, device="meta"), kv_format).num_blocks
        == 3
    )


def test_non_attention_spec_is_refused():
    with pytest.raises(TypeError, match="expected a vLLM AttentionSpec"):
        LayerKVFormat.from_vllm(object())


def test_the_cpu_backend_named_alongside_the_spec_reads_its_cache():
    vllm_spec = kv_cache_interface.FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )
    kv_format = LayerKVFormat.from_vllm(vllm_spec, attention_backend="CPU_ATTN")
    assert kv_format.cpu_attention
    geometry = describe_layer(
        "layers.0", torch.empty(6, 2, 128, 64, dtype=torch.bfloat16, device="meta"), kv_format
    )
    assert geometry.num_blocks == 6 and geometry.block_bytes == 2 * 128 * 64 * 2


def test_vllms_cpu_backend_is_named_as_the_format_expects():
    cpu_attn = pytest.importorskip(
        "vllm.v1.attention.backends.cpu_attn", reason="vLLM build without the CPU backend"
    )
    assert cpu_attn.CPUAttentionBackend.get_name() == "CPU_ATTN"
