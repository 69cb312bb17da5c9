"""A tiny Llama with saved random weights: a real model vLLM loads, made offline in a second.

vLLM's ``load_format="dummy"`` weights are so small that the output hardly depends on the
KV cache, which would hide a wrong transfer; random weights at a normal scale make every
token depend on every cached value. The same seed always gives the same weights. Making
one needs torch and transformers: ``make_tiny_llama_with`` has the vLLM CPU build's python
make it (vLLM needs transformers to load the model anyway), so the serving extra need not.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ..errors import MoriioFsmError

#: The model's shape: 2 layers, 2 KV heads of 32 (GQA), a 1024-token vocabulary.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: The weights' scale: that of a trained model, so every logit depends on the whole context.
WEIGHT_STD = 0.08


class ModelError(MoriioFsmError, RuntimeError):
    """The model could not be made (the python asked to make it failed; its output says why)."""


def _stamp(shape: dict, seed: int, std: float) -> str:
    return json.dumps({"shape": shape, "seed": seed, "std": std}, sort_keys=True)


def is_made(
    folder: str | Path, shape: dict = TINY_LLAMA, seed: int = 0, std: float = WEIGHT_STD
) -> bool:
    """Whether ``folder`` holds the weights of exactly this shape, seed and scale."""
    folder = Path(folder)
    stamp = folder / "moriio-fsm-model.json"
    return (
        (folder / "model.safetensors").is_file()
        and stamp.is_file()
        and stamp.read_text() == _stamp(shape, seed, std)
    )


def make_llama(folder: str | Path, shape: dict, seed: int = 0, std: float = WEIGHT_STD) -> Path:
    """Write ``config.json`` and random ``model.safetensors`` of a Llama of ``shape`` to ``folder``.

    Kept when a stamp in the folder says the same shape, seed and weight scale made it, and
    made again otherwise (a folder left by another seed must not pass for this one).
    ``std`` is the weights' scale. Needs torch and transformers in this process.
    """
    folder = Path(folder)
    if is_made(folder, shape, seed, std):
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{
            k: v
            for k, v in shape.items()
            if k not in ("architectures", "model_type", "torch_dtype")
        }
    )
    # transformers wraps PreTrainedModel.to in a decorator whose type loses the bound self.
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, std)
    model.save_pretrained(folder, safe_serialization=True)
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text())
    data["architectures"] = ["LlamaForCausalLM"]
    data["torch_dtype"] = "bfloat16"
    config_path.write_text(json.dumps(data, indent=1))
    (folder / "moriio-fsm-model.json").write_text(_stamp(shape, seed, std))
    return folder


def make_tiny_llama(folder: str | Path, seed: int = 0) -> Path:
    """The demo's model (``TINY_LLAMA``) in ``folder``; see ``make_llama``."""
    return make_llama(folder, TINY_LLAMA, seed)


def make_tiny_llama_with(
    python: str, folder: str | Path, seed: int = 0, timeout_s: float = 600.0
) -> Path:
    """The demo's model in ``folder``, made by ``python`` (``main`` below) unless already there.

    ``python`` is the vLLM CPU build's: it has torch and transformers, at the versions the
    servers that load the model use. A failure raises ``ModelError`` with that output's tail.
    """
    folder = Path(folder)
    if is_made(folder, TINY_LLAMA, seed):
        return folder
    command = [python, "-m", "moriio_fsm.serving.tiny_model", str(folder), "--seed", str(seed)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelError(f"could not make the model in {folder} with {python}: {exc}") from None
    if done.returncode != 0 or not is_made(folder, TINY_LLAMA, seed):
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise ModelError(
            f"{python} could not make the model in {folder} (exit code "
            f"{done.returncode}); it said:\n{tail}"
        )
    return folder


def main(argv: list[str] | None = None) -> int:
    """``python -m moriio_fsm.serving.tiny_model FOLDER [--seed N]``: make the model, print its folder.

    Run with the vLLM CPU build's python: it has torch and transformers, which the main
    environment need not have.
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m moriio_fsm.serving.tiny_model",
        description="Write a tiny Llama with saved random weights.",
    )
    parser.add_argument("folder", help="where config.json and model.safetensors go")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    args = parser.parse_args(argv)
    print(make_tiny_llama(args.folder, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
