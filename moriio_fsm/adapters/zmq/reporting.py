"""What the transport's I/O thread tells the world: its counters and its warnings.

Rules: counters are plain ints written only by the I/O thread (cheap on the hot path);
warnings about what peers send are rate-limited, so a flood of junk cannot flood the log.
"""

from __future__ import annotations

from ...logs import get_logger

__all__ = ["LogLimiter", "TransportCounts"]

log = get_logger("moriio_fsm.adapters.zmq")


class TransportCounts:
    """Event counters of one transport; ``as_dict`` is what ``ZmqTransport.stats`` shows."""

    __slots__ = (
        "received", "delivered", "rejected", "callback_errors", "sent", "send_failed",
        "senders_opened", "auth_refused", "handshake_failed", "handshakes_served", "io_errors",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class LogLimiter:
    """At most ``per_second`` warnings a second; the rest are counted and summarised."""

    def __init__(self, per_second: int = 20) -> None:
        self.per_second = per_second
        self.window = 0.0
        self.count = 0
        self.suppressed = 0

    def allow(self, now: float) -> bool:
        if now - self.window >= 1.0:
            if self.suppressed:
                log.warning("zmq.messages_suppressed", count=self.suppressed)
            self.window, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count <= self.per_second:
            return True
        self.suppressed += 1
        return False
