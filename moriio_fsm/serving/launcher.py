"""Start a P/D deployment on this machine: prefill and decode vLLM servers with the connector.

Each instance gets its own ports (HTTP, the connector's notify and handshake ports: drawn
free, or three in a row from a first port), a core (instances take the cores this process
may use in turn), its own log and trace file. One host may run both roles or only one of
them, for a deployment across hosts; the backend and the address the servers and their
connectors listen on are the deployment's, checked when it is made. ``start`` waits until every server is healthy, showing progress on stderr; ``stop``
ends every process it started, by process group, whatever happened before (also on
Ctrl-C: use the deployment as a context manager).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .backends import check_backend
from .instances import Instance, ProxyConfig
from .vllm_server import ServerConfig, ServerError, VllmServer, stop_all, vllm_cpu_python

CONNECTOR = {
    "kv_connector": "MoRIIOFSMConnector",
    "kv_connector_module_path": "moriio_fsm.vllm.connector",
}
FAILURE_POLICIES = ("fail", "recompute")
ROLES = ("prefill", "decode")


#: Ports are taken below Linux's ephemeral range (32768-60999 by default): a port picked
#: there can be handed to some other process's outgoing connection in the seconds before
#: the server that was to listen on it has started.
PORT_RANGE = (20000, 32000)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 just now, outside the ephemeral range."""
    chance = random.SystemRandom()
    found: list[int] = []
    for _ in range(count * 200):
        if len(found) == count:
            break
        port = chance.randrange(*PORT_RANGE)
        if port in found:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
    if len(found) < count:
        raise OSError(f"found only {len(found)} free ports in {PORT_RANGE[0]}-{PORT_RANGE[1]}")
    return found


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


@dataclass
class Member:
    """One instance of the deployment: its server and where its connector listens."""

    name: str
    role: str  # "prefill" | "decode"
    server: VllmServer
    notify_port: int
    handshake_port: int
    trace_file: Path

    def instance(self) -> Instance:
        return Instance(
            self.name,
            self.server.url,
            self.server.config.host,
            self.notify_port,
            self.handshake_port,
        )


@dataclass
class PdDeployment:
    """``prefills`` P and ``decodes`` D servers of ``model`` in one mode, logs under ``workdir``.

    ``roles`` are the roles this host runs (both, or one side of a deployment across
    hosts); ``host`` is the address its servers and connectors listen on, ``trusted_peers``
    the hosts (or CIDRs) their connectors accept (unset: loopback only); ``first_port``
    gives each instance three ports in a row from it (HTTP, notify, handshake) instead of
    free ones drawn at random.
    """

    model: str
    mode: str
    workdir: Path
    prefills: int = 1
    decodes: int = 1
    connector_extra: dict[str, Any] = field(default_factory=dict)
    failure_policy: str = "fail"
    block_size: int = 128
    kv_cache_bytes: int = 256 << 20
    max_model_len: int = 2048
    python: str | None = None
    backend: str = "same_host"
    roles: tuple[str, ...] = ROLES
    host: str = "127.0.0.1"
    trusted_peers: tuple[str, ...] = ()
    first_port: int | None = None
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in ("write", "read"):
            raise ValueError(f"mode: expected write or read, got {self.mode!r}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"failure_policy: expected one of {', '.join(FAILURE_POLICIES)}, "
                f"got {self.failure_policy!r}"
            )
        for count, what in ((self.prefills, "prefills"), (self.decodes, "decodes")):
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 8:
                raise ValueError(f"{what}: expected 1 to 8 instances, got {count!r}")
        self.backend = check_backend(self.backend)
        if not self.roles or any(role not in ROLES for role in self.roles):
            raise ValueError(f"roles: expected prefill, decode or both, got {self.roles!r}")
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"host: expected an address to listen on, got {self.host!r}")
        if isinstance(self.trusted_peers, str):
            raise ValueError(
                f"trusted_peers: expected a list of hosts or CIDRs, got the string {self.trusted_peers!r}"
            )
        self.trusted_peers = tuple(self.trusted_peers)
        if self.first_port is not None:
            last = self.first_port + 3 * self.instance_count() - 1
            if isinstance(self.first_port, bool) or not 1 <= self.first_port <= last <= 65535:
                raise ValueError(
                    f"first_port: expected a port from which {3 * self.instance_count()} ports "
                    f"in a row stay within 1-65535, got {self.first_port!r}"
                )
        self.workdir = Path(self.workdir)

    def instance_count(self) -> int:
        """How many servers this host starts: the instances of the roles it runs."""
        return (self.prefills if "prefill" in self.roles else 0) + (
            self.decodes if "decode" in self.roles else 0
        )

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> PdDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, *, timeout_s: float = 300.0, show_progress: bool = True) -> None:
        if self.members:
            raise ServerError("this deployment was started already; make a new one")
        python = self.python or vllm_cpu_python()
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (self.workdir / "traces").mkdir(parents=True, exist_ok=True)
        cores = usable_cores()
        names: list[tuple[str, str]] = []
        if "prefill" in self.roles:
            names += [(f"P{i}", "prefill") for i in range(self.prefills)]
        if "decode" in self.roles:
            names += [(f"D{i}", "decode") for i in range(self.decodes)]
        # P0, D0, P1, D1...: a P and a D never share a core while there are two.
        order = sorted(names, key=lambda n: (int(n[0][1:]), n[1] != "prefill"))
        if self.first_port is None:
            ports = free_ports(3 * len(order))  # one draw: no two servers share a port
        else:
            ports = list(range(self.first_port, self.first_port + 3 * len(order)))
        try:
            for position, (name, role) in enumerate(order):
                http, notify, handshake = ports[3 * position : 3 * position + 3]
                trace = self.workdir / "traces" / f"{name}.jsonl"
                trace.unlink(missing_ok=True)  # traces append: a new run starts afresh
                extra = {
                    "backend": self.backend,
                    "read_mode": self.mode == "read",
                    "host_ip": self.host,
                    "notify_port": notify,
                    "handshake_port": handshake,
                    "trace_file": str(trace),
                    **({"trusted_peers": list(self.trusted_peers)} if self.trusted_peers else {}),
                    **self.connector_extra,
                }
                transfer = {
                    **CONNECTOR,
                    "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                    "engine_id": name,
                    "kv_load_failure_policy": self.failure_policy,
                    "kv_connector_extra_config": extra,
                }
                config = ServerConfig(
                    name,
                    self.model,
                    http,
                    cores[position % len(cores)],
                    transfer,
                    block_size=self.block_size,
                    kv_cache_bytes=self.kv_cache_bytes,
                    max_model_len=self.max_model_len,
                    host=self.host,
                )
                server = VllmServer(config, self.workdir / "logs" / f"{name}.log", python=python)
                self.members.append(Member(name, role, server, notify, handshake, trace))
            wait_all([m.server for m in self.members], timeout_s, show_progress)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every server this deployment started, all at once (idempotent)."""
        stop_all([member.server for member in self.members])

    def wait_for_an_exit(self, poll_s: float = 1.0) -> Member:
        """Block until one of the servers exits (it crashed, or was killed); that one."""
        if not self.members:
            raise ServerError("this deployment has no server running; start it first")
        while True:
            for member in self.members:
                if member.server.process.poll() is not None:
                    return member
            time.sleep(poll_s)

    def kill(self, name: str) -> None:
        """Crash one instance (SIGKILL to its whole process group), as a fault run does."""
        member = self.member(name)
        try:
            os.killpg(member.server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        member.server.process.wait(10)

    # -- what others need ------------------------------------------------------------------------

    def member(self, name: str) -> Member:
        for member in self.members:
            if member.name == name:
                return member
        raise KeyError(
            f"no instance {name!r} in this deployment ({', '.join(m.name for m in self.members)})"
        )

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.server.process.poll() is None]

    def proxy_config(self, **options: Any) -> ProxyConfig:
        return ProxyConfig(
            self.mode,
            [m.instance() for m in self.members if m.role == "prefill"],
            [m.instance() for m in self.members if m.role == "decode"],
            **options,
        )


def wait_all(servers: list[VllmServer], timeout_s: float, show_progress: bool) -> None:
    """Wait until every server is healthy; a progress line per server on stderr."""
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    started = time.monotonic()
    ready: dict[str, float] = {}
    console = Console(stderr=True)

    def view() -> Table:
        table = Table(show_header=False, box=None)
        for server in servers:
            name = server.config.name
            state = (
                f"[green]ready[/] in {ready[name]:.0f}s"
                if name in ready
                else f"starting... {time.monotonic() - started:.0f}s"
            )
            table.add_row(f"{name}", f"{server.url}", f"core {server.config.core}", state)
        return table

    with (
        Live(
            view(),
            console=console,
            transient=False,
            refresh_per_second=2,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        if show_progress
        else nullcontext() as live
    ):
        while len(ready) < len(servers):
            for server in servers:
                if server.config.name in ready:
                    continue
                if server.process.poll() is not None:
                    raise ServerError(
                        f"{server.config.name} (pid {server.pid}) exited with "
                        f"{server.process.returncode} before it was ready; its log "
                        f"{server.log_path} ends:\n{server.log_tail()}"
                    )
                if server.healthy():
                    ready[server.config.name] = time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                late = [s for s in servers if s.config.name not in ready]
                raise ServerError(
                    f"{', '.join(s.config.name for s in late)} not ready after "
                    f"{timeout_s:.0f}s; {late[0].log_path} ends:\n{late[0].log_tail()}"
                )
            if live is not None:
                live.update(view())
            time.sleep(0.5)
    if show_progress and not console.is_terminal:
        console.line()  # a file or pipe gets no newline after the last frame
