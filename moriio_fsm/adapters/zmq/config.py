"""The settings of one ZeroMQ transport, checked once when they are made.

Rules: a bad setting raises ``ValueError`` naming it and what was expected; the transport
and the sockets, handshakes and outboxes of its I/O thread read the settings, never
change them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .curve import CurveConfig
from .messages import Role
from .ports import listener_port
from .wire_limits import DEFAULT_LIMITS, WireLimits

__all__ = ["TransportConfig"]


@dataclass(frozen=True)
class TransportConfig:
    """Settings of one transport (one per worker rank).

    ``notify_base_port`` with the ranks gives the listener port through
    ``listener_port``; 0 binds an ephemeral port (tests).  ``bind_host`` None
    means ``default_bind_host()``.  ``trusted_peers`` feeds ``PeerPolicy``
    (empty: loopback only).  ``curve`` turns on CURVE for every socket.
    ``send_timeout_s`` bounds how long a message may wait for its peer before it
    is reported failed; ``max_peers`` bounds the cache of sender sockets.
    ``max_queued_sends`` and ``max_queued_commands`` bound the work waiting for
    the I/O thread, ``max_pending_handshakes`` the handshakes queued or in
    flight; beyond them new work is refused with ``TransportBusyError``.
    libzmq allows 1023 sockets per context by default, so ``max_peers`` plus
    ``max_pending_handshakes`` plus served handshake ports must stay below it.
    """

    role: Role
    notify_base_port: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    bind_host: str | None = None
    listen: bool = True
    trusted_peers: tuple[str, ...] = ()
    curve: CurveConfig | None = None
    limits: WireLimits = DEFAULT_LIMITS
    max_peers: int = 64
    send_hwm: int = 10_000
    recv_hwm: int = 10_000
    send_timeout_s: float = 5.0
    linger_ms: int = 500
    tcp_keepalive_idle_s: int = 30
    tcp_keepalive_interval_s: int = 5
    tcp_keepalive_count: int = 6
    max_batch: int = 256
    max_queued_sends: int = 65_536
    max_queued_commands: int = 1_024
    max_pending_handshakes: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ValueError(f"role: expected Role.PRODUCER or Role.CONSUMER, got {self.role!r}")
        if self.notify_base_port != 0:
            listener_port(
                self.notify_base_port,
                dp_rank=self.dp_rank,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
            )
        for name in (
            "max_peers",
            "send_hwm",
            "recv_hwm",
            "max_batch",
            "max_queued_sends",
            "max_queued_commands",
            "max_pending_handshakes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.send_timeout_s > 0:
            raise ValueError(f"send_timeout_s: must be > 0, got {self.send_timeout_s}")
        if isinstance(self.trusted_peers, str):
            raise ValueError(
                "trusted_peers: expected a sequence of hosts/CIDRs, got a single string"
            )

    @property
    def notify_port(self) -> int:
        if self.notify_base_port == 0:
            return 0
        return listener_port(
            self.notify_base_port, dp_rank=self.dp_rank, tp_rank=self.tp_rank, tp_size=self.tp_size
        )
