"""The instances behind the P/D proxy and its settings: who they are, which are up, in turn.

An instance is one vLLM server (its HTTP URL and, in WRITE mode, where its connector
listens). A pool hands out the instances of one role round robin, skipping those marked
down; marking up and down happens under the pool's lock. Bad specs and settings raise
``ProxyConfigError`` naming the instance or the setting.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from ..errors import MoriioFsmError
from ..logs import get_logger

log = get_logger("moriio_fsm.serving.proxy")

MODES = ("write", "read")


class ProxyConfigError(MoriioFsmError, ValueError):
    """An instance spec or a proxy setting that cannot be used."""


@dataclass
class Instance:
    """One vLLM server behind the proxy; ``kv_*`` is where its connector listens (WRITE mode)."""

    name: str
    url: str
    kv_host: str | None = None
    notify_port: int | None = None
    handshake_port: int | None = None
    tp_size: int = 1
    up: bool = True
    down_since: float | None = None
    last_error: str = ""
    served: int = 0

    @classmethod
    def parse(cls, name: str, spec: str) -> Instance:
        """``URL[,kv=HOST:NOTIFY_PORT:HANDSHAKE_PORT][,tp=N]`` (HOST may be ``[v6]``; ``tp``:
        the instance's tensor-parallel size, which a D with a different one must be told)."""
        url, *options = spec.split(",")
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest.strip("/"):
            raise ProxyConfigError(
                f"instance {name}: expected URL[,kv=HOST:NOTIFY:HANDSHAKE][,tp=N] "
                f"with an http:// URL and a host, got {spec!r}"
            )
        instance = cls(name, url.rstrip("/"))
        for option in options:
            key, _, value = option.partition("=")
            if key == "kv" and instance.kv_host is None:
                instance.kv_host, instance.notify_port, instance.handshake_port = _kv(name, value)
            elif key == "tp" and value.isdigit() and 1 <= int(value) <= 4096:
                instance.tp_size = int(value)
            else:
                raise ProxyConfigError(
                    f"instance {name}: unexpected {option!r} in {spec!r}; the options are "
                    "kv=HOST:NOTIFY:HANDSHAKE and tp=N (N in 1-4096), each at most once"
                )
        return instance

    def peer_params(self) -> dict[str, Any]:
        """What the other side's connector needs to reach this instance's connector."""
        return {
            "remote_host": self.kv_host,
            "remote_notify_port": self.notify_port,
            "remote_handshake_port": self.handshake_port,
            "remote_tp_size": self.tp_size,
        }

    def describe(self) -> dict[str, Any]:
        """The instance as ``GET /health`` shows it."""
        return {
            "name": self.name,
            "url": self.url,
            "up": self.up,
            "served": self.served,
            "down_since": self.down_since,
            "last_error": self.last_error,
        }


def _kv(name: str, kv: str) -> tuple[str, int, int]:
    """(host, notify port, handshake port) from ``HOST:NOTIFY_PORT:HANDSHAKE_PORT``."""
    rest_kv, _, handshake = kv.rpartition(":")
    host, _, notify = rest_kv.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ports = (notify, handshake)
    if not host or not all(p.isdigit() and 0 < int(p) < 65536 for p in ports):
        raise ProxyConfigError(
            f"instance {name}: kv= expects HOST:NOTIFY_PORT:HANDSHAKE_PORT "
            f"with a host and ports in 1-65535, got {kv!r}"
        )
    return host, int(notify), int(handshake)


class Pool:
    """Round robin over the instances of one role, skipping those marked down."""

    def __init__(self, role: str, instances: list[Instance]):
        if not instances:
            raise ProxyConfigError(f"the proxy needs at least one {role} instance")
        self.role = role
        self.instances = instances
        self._next = 0
        self._lock = threading.Lock()

    def pick(self, exclude: AbstractSet[str] = frozenset()) -> Instance | None:
        """The next instance that is up and not in ``exclude``, or None."""
        with self._lock:
            for offset in range(len(self.instances)):
                candidate = self.instances[(self._next + offset) % len(self.instances)]
                if candidate.up and candidate.name not in exclude:
                    self._next = (self._next + offset + 1) % len(self.instances)
                    return candidate
        return None

    def mark_down(self, instance: Instance, why: str) -> None:
        with self._lock:
            if instance.up:
                log.warning(
                    "proxy.instance_down",
                    role=self.role,
                    instance=instance.name,
                    url=instance.url,
                    why=why,
                )
                instance.up, instance.down_since = False, time.time()
            instance.last_error = why

    def mark_up(self, instance: Instance) -> None:
        with self._lock:
            if not instance.up:
                log.info(
                    "proxy.instance_up", role=self.role, instance=instance.name, url=instance.url
                )
                instance.up, instance.down_since = True, None

    def unavailable(self) -> str:
        """Why no instance can be picked: each one that is down, and its last error."""
        return (
            "; ".join(
                f"{i.name} ({i.url}) down: {i.last_error or 'unknown'}"
                for i in self.instances
                if not i.up
            )
            or "none configured"
        )


@dataclass
class ProxyConfig:
    """The proxy's mode, its instances and its limits."""

    mode: str
    prefills: list[Instance]
    decodes: list[Instance]
    request_timeout_s: float = 120.0  # longest silence from an instance
    connect_timeout_s: float = 5.0
    probe_interval_s: float = 2.0
    max_body_bytes: int = 8 << 20
    # Clients: connections open at once (one over is answered 503), the time a request's
    # head and then its whole body may take to arrive (a slow one is cut).
    max_connections: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Connections to the instances: a request holds up to two (P's and D's) at once.
    upstream_connections: int = 512
    extra_prefill_params: dict[str, Any] = field(default_factory=dict)
    # READ mode: P's first token goes to the client at once, D continues after it.
    first_token_from_prefill: bool = True
    # A span of the proxy's own per request, exported over OTLP (the ``otel`` extra);
    # the client's trace context goes on to P and D either way.
    otel: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ProxyConfigError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "probe_interval_s",
            "header_timeout_s",
            "body_timeout_s",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ProxyConfigError(
                    f"{name}: expected a positive finite number of seconds, got {value!r}"
                )
        for name in ("max_body_bytes", "max_connections", "upstream_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProxyConfigError(f"{name}: expected a positive integer, got {value!r}")
        if type(self.first_token_from_prefill) is not bool:
            raise ProxyConfigError(
                "first_token_from_prefill: expected true or false, "
                f"got {self.first_token_from_prefill!r}"
            )
        names = [i.name for i in self.prefills + self.decodes]
        if len(set(names)) != len(names):
            raise ProxyConfigError(f"instance names must be distinct, got {names}")
        if self.mode == "write":
            for instance in self.prefills + self.decodes:
                if instance.notify_port is None:
                    raise ProxyConfigError(
                        f"instance {instance.name}: WRITE mode needs where its connector listens "
                        f"(URL,kv=HOST:NOTIFY_PORT:HANDSHAKE_PORT), got only {instance.url}"
                    )
