"""The demo's tiny Llama: the same seed gives the same weights, and a folder made by another seed is made again."""

import hashlib
import json

from moriio_fsm.serving.tiny_model import TINY_LLAMA, make_tiny_llama


def digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_a_folder_is_kept_for_its_seed_and_made_again_for_another(tmp_path):
    first = make_tiny_llama(tmp_path / "model", seed=0)
    made_at = (first / "model.safetensors").stat().st_mtime_ns
    seed0 = digest(first)
    assert make_tiny_llama(tmp_path / "model", seed=0) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == made_at     # kept, not rewritten
    make_tiny_llama(tmp_path / "model", seed=1)
    assert digest(first) != seed0                                          # another seed, other weights
    make_tiny_llama(tmp_path / "model", seed=0)
    assert digest(first) == seed0                                          # and the same seed, the same ones
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == TINY_LLAMA["num_hidden_layers"]


def test_a_folder_without_a_stamp_is_made_again(tmp_path):
    folder = make_tiny_llama(tmp_path / "model")
    (folder / "moriio-fsm-model.json").unlink()
    (folder / "model.safetensors").write_bytes(b"not weights")
    make_tiny_llama(folder)
    assert (folder / "model.safetensors").stat().st_size > 1000
