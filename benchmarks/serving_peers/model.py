"""A Llama of a chosen shape with saved random weights, for the serving race.

The race needs more KV per token than the demo's tiny model (at least 16 MiB per
request), so the shape is a parameter here; the weights are random at a trained model's
scale (every token depends on the whole context) and the same seed gives the same model.
"""

from __future__ import annotations

from pathlib import Path

from moriio_fsm.serving.tiny_model import make_llama as make_any_llama

#: 8 layers x 8 KV heads x head_dim 64 x (K and V) x bf16 = 16 KiB of KV per token; a narrow
#: residual (256) and MLP keep one prefill of ~1100 tokens cheap on one core.
RACE_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 8,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def kv_bytes_per_token(shape: dict, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token."""
    return (
        2
        * shape["num_hidden_layers"]
        * shape["num_key_value_heads"]
        * shape["head_dim"]
        * dtype_bytes
    )


def make_llama(folder: str | Path, shape: dict | None = None, seed: int = 0) -> Path:
    """The race's model (``RACE_LLAMA`` unless ``shape``) in ``folder``, weights at 1.5/sqrt(hidden)."""
    shape = dict(RACE_LLAMA if shape is None else shape)
    # std 1/sqrt(hidden): logits stay sensitive to every cached value without overflowing.
    return make_any_llama(folder, shape, seed, std=shape["hidden_size"] ** -0.5 * 1.5)
