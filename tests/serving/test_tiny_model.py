"""The demo's tiny Llama: the same seed gives the same weights, a folder made by another seed
is made again, and the python that has transformers (vLLM's) makes it for one that has not."""

import hashlib
import json
import sys

import pytest

from moriio_fsm.serving.tiny_model import (
    TINY_LLAMA,
    ModelError,
    is_made,
    make_tiny_llama,
    make_tiny_llama_with,
)


def digest(folder) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_a_folder_is_kept_for_its_seed_and_made_again_for_another(tmp_path):
    first = make_tiny_llama(tmp_path / "model", seed=0)
    made_at = (first / "model.safetensors").stat().st_mtime_ns
    seed0 = digest(first)
    assert make_tiny_llama(tmp_path / "model", seed=0) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == made_at  # kept, not rewritten
    make_tiny_llama(tmp_path / "model", seed=1)
    assert digest(first) != seed0  # another seed, other weights
    make_tiny_llama(tmp_path / "model", seed=0)
    assert digest(first) == seed0  # and the same seed, the same ones
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == TINY_LLAMA["num_hidden_layers"]


def test_a_folder_without_a_stamp_is_made_again(tmp_path):
    folder = make_tiny_llama(tmp_path / "model")
    (folder / "moriio-fsm-model.json").unlink()
    (folder / "model.safetensors").write_bytes(b"not weights")
    make_tiny_llama(folder)
    assert (folder / "model.safetensors").stat().st_size > 1000


def test_the_given_python_makes_the_model_so_this_one_needs_no_transformers(tmp_path, monkeypatch):
    # The serving extra has no transformers; the vLLM CPU build's python makes the model.
    with monkeypatch.context() as here:
        here.setitem(sys.modules, "transformers", None)  # any import of it here fails
        folder = make_tiny_llama_with(sys.executable, tmp_path / "model", seed=3)
    assert is_made(folder, TINY_LLAMA, seed=3) and not is_made(folder, TINY_LLAMA, seed=0)
    assert digest(folder) == digest(make_tiny_llama(tmp_path / "here", seed=3))  # the same weights


def test_a_python_that_cannot_make_the_model_is_named(tmp_path):
    with pytest.raises(ModelError, match="/bin/false could not make the model"):
        make_tiny_llama_with("/bin/false", tmp_path / "model")
    with pytest.raises(ModelError, match="no-such-python"):
        make_tiny_llama_with(str(tmp_path / "no-such-python"), tmp_path / "model")
