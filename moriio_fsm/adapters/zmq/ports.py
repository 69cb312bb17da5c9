"""The one rule that maps a rank to its listener port: ``base + dp_rank * tp_size + tp_rank``.

Rules: every listener binds and every sender dials it; ``tp_size`` is required (upstream sometimes drops it, so
(dp0, tp1) and (dp1, tp0) collide) and every argument is range-checked.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankEndpoint", "listener_port"]

_MAX_PORT = 65_535


def listener_port(base_port: int, *, dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """Return the port the rank ``(dp_rank, tp_rank)`` listens on.

    Raises ``ValueError`` naming the argument when a rank is negative, ``tp_rank``
    is not below ``tp_size``, or the result is not a valid TCP port.
    """
    for name, value in (
        ("base_port", base_port),
        ("dp_rank", dp_rank),
        ("tp_rank", tp_rank),
        ("tp_size", tp_size),
    ):
        if type(value) is not int:
            raise ValueError(f"{name}: expected an integer, got {type(value).__name__}")
    if base_port < 1 or base_port > _MAX_PORT:
        raise ValueError(f"base_port: {base_port} is not a TCP port (1..{_MAX_PORT})")
    if dp_rank < 0:
        raise ValueError(f"dp_rank: {dp_rank} must be >= 0")
    if tp_size < 1:
        raise ValueError(f"tp_size: {tp_size} must be >= 1")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: {tp_rank} must be in [0, tp_size={tp_size})")
    port = base_port + dp_rank * tp_size + tp_rank
    if port > _MAX_PORT:
        raise ValueError(
            f"base_port {base_port} + dp_rank {dp_rank} * tp_size {tp_size} + tp_rank {tp_rank} = {port} exceeds {_MAX_PORT}"
        )
    return port


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """A peer rank's listener: ``host`` plus the port ``listener_port`` gives it."""

    host: str
    base_port: int
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def port(self) -> int:
        return listener_port(
            self.base_port, dp_rank=self.dp_rank, tp_rank=self.tp_rank, tp_size=self.tp_size
        )
