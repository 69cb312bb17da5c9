"""Several "hosts" on one machine for tests: each one a network, PID, IPC, UTS and mount
namespace of its own, all joined by a bridge, addresses from the benchmarking range.

A host shares nothing with another but the bridge: no loopback, no process it can see (so
no cross-memory attach), no System V IPC, its own /dev/shm and hostname. The test process
sits on the bridge too (``.254``), as a client on the same network. Rules: only
198.18.0.0/15 addresses, never a private range; every process a host runs is started, and
stopped, by its pid; ``Network.close`` removes every namespace, veth and the bridge it
made, and kills by pid whatever still runs in them, whatever happened before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def run(*command: str) -> str:
    """Run an ``ip``-like command; its output, or ``RuntimeError`` with its message."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def why_namespaces_cannot_run() -> str | None:
    """Why this machine cannot make the hosts (not root, no ``ip netns``, no ``unshare``)."""
    if os.geteuid() != 0:
        return "network namespaces and bridges need root"
    probe = f"mfxprobe{os.getpid()}"
    try:
        run("ip", "netns", "add", probe)
        try:
            run("ip", "netns", "exec", probe, "unshare", "--pid", "--fork", "--mount-proc",
                "--ipc", "--uts", "true")  # fmt: skip
        finally:
            run("ip", "netns", "del", probe)
    except (RuntimeError, OSError) as exc:
        return f"cannot make a network and PID namespace here: {exc}"
    return None


def free_subnet() -> int:
    """A third octet N such that no interface here has an address in 198.18.N.0/24."""
    taken = run("ip", "-o", "-4", "addr", "show")
    for offset in range(250):
        n = (os.getpid() + offset) % 250 + 1
        if f" 198.18.{n}." not in taken:
            return n
    raise RuntimeError("every 198.18.N.0/24 with N in 1-250 is in use here")


class Host:
    """One namespace on the bridge, and the one command it runs (its init process)."""

    def __init__(self, network: Network, name: str, address: str, cores: str):
        self.network, self.name, self.address, self.cores = network, name, address, cores
        self.netns = f"{network.tag}-{name}"
        self.veth = f"{network.tag}{name}"  # the end inside the namespace
        self.port = f"{network.tag}{name}b"  # the end on the bridge
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def start(self, command: list[str], log_path: Path) -> None:
        """Run ``command`` as this host's init (PID 1 of its own PID namespace)."""
        setup = f'hostname {self.netns}; mount -t tmpfs tmpfs /dev/shm; exec "$@"'
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    "taskset",
                    "-c",
                    self.cores,
                    "ip",
                    "netns",
                    "exec",
                    self.netns,
                    "unshare",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--mount-proc",
                    "--ipc",
                    "--uts",
                    "sh",
                    "-c",
                    setup,
                    "sh",
                    *command,
                ],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def init_pid(self, timeout_s: float = 10.0) -> int:
        """The host pid of this host's init (the command), once unshare has forked it."""
        assert self.process is not None, f"{self.name} runs nothing"
        deadline = time.monotonic() + timeout_s
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        while time.monotonic() < deadline:
            try:
                found = children.read_text().split()
            except OSError:
                found = []
            if found:
                return int(found[0])
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: unshare (pid {self.process.pid}) forked nothing")

    def pids(self) -> list[int]:
        """Every process in this host's network namespace, by host pid."""
        try:
            return [int(p) for p in run("ip", "netns", "pids", self.netns).split()]
        except RuntimeError:
            return []

    def signal_all(self, signum: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the init (it stops what it started), SIGKILL to every process left."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.kill(self.init_pid(timeout_s=2.0), signal.SIGTERM)
                self.process.wait(timeout_s)
            except (RuntimeError, ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.signal_all(signal.SIGCONT)  # a stopped process cannot die of SIGTERM
        self.signal_all(signal.SIGKILL)
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(10)


class Network:
    """A bridge with the test on it (198.18.N.254) and hosts at 198.18.N.1, .2, ..."""

    def __init__(self) -> None:
        self.tag = f"mfx{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.subnet = free_subnet()
        self.hosts: list[Host] = []
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", self.address(254) + "/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")

    def address(self, last: int) -> str:
        return f"198.18.{self.subnet}.{last}"

    def add_host(self, name: str, cores: str) -> Host:
        host = Host(self, name, self.address(len(self.hosts) + 1), cores)
        self.hosts.append(host)
        run("ip", "netns", "add", host.netns)
        run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", host.port)
        run("ip", "link", "set", host.veth, "netns", host.netns)
        run("ip", "link", "set", host.port, "master", self.bridge, "up")
        inside = ("ip", "netns", "exec", host.netns)
        run(*inside, "ip", "addr", "add", host.address + "/24", "dev", host.veth)
        run(*inside, "ip", "link", "set", host.veth, "up")
        run(*inside, "ip", "link", "set", "lo", "up")
        return host

    def bytes_sent_by(self, host: Host) -> int:
        """Bytes ``host`` sent onto the bridge so far (its bridge port's received bytes)."""
        return int(Path(f"/sys/class/net/{host.port}/statistics/rx_bytes").read_text())

    def close(self) -> list[str]:
        """Stop every host, delete every namespace and link; what could not be removed."""
        problems = []
        for host in self.hosts:
            host.stop()
        for host in self.hosts:
            for command in (("ip", "netns", "del", host.netns), ("ip", "link", "del", host.port)):
                try:
                    run(*command)
                except RuntimeError as exc:  # the veth goes with its namespace: expected
                    if "netns" in command[1]:
                        problems.append(str(exc))
        try:
            run("ip", "link", "del", self.bridge)
        except RuntimeError as exc:
            problems.append(str(exc))
        return problems

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network still present (none after ``close``)."""
        names = run("ip", "netns", "list") + run("ip", "-o", "link", "show")
        return sorted({word for word in names.split() if word.startswith(self.tag)})
