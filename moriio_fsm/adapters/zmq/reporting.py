"""What the transport's I/O thread tells the world: its counters and its warnings.

Rules: counters are plain ints written only by the I/O thread (cheap on the hot path);
warnings about what peers send are rate-limited, so a flood of junk cannot flood the log.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ...logs import get_logger

__all__ = ["LogLimiter", "TransportCounts"]

log = get_logger("moriio_fsm.adapters.zmq")


@dataclass(slots=True)
class TransportCounts:
    """Event counters of one transport; ``as_dict`` is what ``ZmqTransport.stats`` shows."""

    received: int = 0  # frames read from the notify listener
    delivered: int = 0  # messages handed to ``on_message``
    rejected: int = 0  # frames refused: undecodable, wrong role, over the limits
    callback_errors: int = 0  # ``on_message`` or ``on_send_failure`` raised
    sent: int = 0
    send_failed: int = 0
    senders_opened: int = 0  # outbound connections made
    auth_refused: int = 0  # connections ZAP turned away
    handshake_failed: int = 0
    handshakes_served: int = 0
    io_errors: int = 0  # unexpected errors contained to one socket or command

    def as_dict(self) -> dict[str, int]:
        return {item.name: getattr(self, item.name) for item in fields(self)}


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
