"""Sender sockets: one DEALER and one bounded backlog per destination, the least recently used evicted.

Rules: used by the I/O thread only; every message handed in is either sent or reported
through ``fail`` exactly once (socket error, full backlog, send timeout, eviction, close).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from .config import TransportConfig
from .sockets import set_keepalive, source_for, tcp_url

if TYPE_CHECKING:
    from .reporting import TransportCounts

__all__ = ["Outbox", "Outboxes", "SendQueue"]

# (host, port, payload, transfer_id, kind): what callers queue for the I/O thread.
SendQueue = collections.deque
# fail(host, port, transfer_id, kind, reason) reports one message that will not be sent.
FailReport = Callable[[str, int, "str | None", str, str], None]


@dataclass
class Outbox:
    """One destination's sender socket and the messages waiting for it to accept more."""

    sock: zmq.Socket
    backlog: collections.deque = field(
        default_factory=collections.deque
    )  # (payload, deadline, tid, kind)
    polling: bool = False  # registered for POLLOUT while the backlog is non-empty


class Outboxes:
    """The sender sockets of one transport, at most ``config.max_peers`` of them."""

    def __init__(
        self,
        ctx: zmq.Context,
        poller: zmq.Poller,
        config: TransportConfig,
        counts: TransportCounts,
        fail: FailReport,
        source: str | None = None,
    ) -> None:
        self._ctx = ctx
        self._source = source  # the address senders connect from (sockets.source_for)
        self._poller = poller
        self._config = config
        self._counts = counts
        self._fail = fail
        self._boxes: collections.OrderedDict[tuple[str, int], Outbox] = collections.OrderedDict()

    @property
    def polling(self) -> bool:
        """True while some destination has a backlog waiting for POLLOUT."""
        return any(o.polling for o in self._boxes.values())

    def send_queued(self, sends: SendQueue) -> None:
        """Send (or queue per destination, or report) everything in ``sends``, emptying it."""
        popleft = sends.popleft
        noblock = zmq.NOBLOCK
        outbox: Outbox | None = None
        last_host, last_port = None, None
        sent = 0
        try:
            while sends:
                host, port, payload, transfer_id, kind = popleft()
                # Consecutive messages usually share a peer: skip the LRU update then.
                if outbox is None or port != last_port or host != last_host:
                    try:
                        outbox = self._outbox(host, port)
                    except Exception as exc:
                        outbox, last_host = None, None
                        self._fail(
                            host, port, transfer_id, kind, f"could not open a sender socket: {exc}"
                        )
                        continue
                    last_host, last_port = host, port
                if not outbox.backlog:
                    try:
                        outbox.sock.send(payload, noblock)
                        sent += 1
                        continue
                    except zmq.Again:
                        self._poller.register(outbox.sock, zmq.POLLOUT)
                        outbox.polling = True
                    except zmq.ZMQError as exc:
                        self._fail(host, port, transfer_id, kind, f"send error: {exc}")
                        continue
                if len(outbox.backlog) >= self._config.send_hwm:
                    self._fail(host, port, transfer_id, kind, "send queue to this peer is full")
                    continue
                outbox.backlog.append(
                    (payload, time.monotonic() + self._config.send_timeout_s, transfer_id, kind)
                )
        finally:
            self._counts.sent += sent

    def flush(self, sock: zmq.Socket) -> None:
        """``sock`` can take more: send its destination's backlog until it cannot."""
        for (host, port), outbox in self._boxes.items():  # noqa: B007 (used after the break)
            if outbox.sock is sock:
                break
        else:
            return
        backlog = outbox.backlog
        while backlog:
            payload, _deadline, transfer_id, kind = backlog[0]
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._fail(host, port, transfer_id, kind, f"send error: {exc}")
            else:
                self._counts.sent += 1
            backlog.popleft()
        self._poller.unregister(sock)
        outbox.polling = False

    def expire(self, now: float) -> None:
        """Report every backlogged message whose send timeout has passed."""
        for (host, port), outbox in self._boxes.items():
            backlog = outbox.backlog
            while backlog and backlog[0][1] <= now:
                _payload, _deadline, transfer_id, kind = backlog.popleft()
                self._fail(
                    host,
                    port,
                    transfer_id,
                    kind,
                    f"peer not reachable within send timeout ({self._config.send_timeout_s}s)",
                )
            if not backlog and outbox.polling:
                self._poller.unregister(outbox.sock)
                outbox.polling = False

    def close(self) -> None:
        """Close every sender socket, reporting what was still backlogged."""
        while self._boxes:
            (host, port), outbox = self._boxes.popitem(last=False)
            self._discard(host, port, outbox, "transport closed before the message was sent")

    def _outbox(self, host: str, port: int) -> Outbox:
        key = (host, port)
        outbox = self._boxes.get(key)
        if outbox is not None:
            self._boxes.move_to_end(key)
            return outbox
        config = self._config
        while len(self._boxes) >= config.max_peers:
            (old_host, old_port), old = self._boxes.popitem(last=False)
            self._discard(
                old_host, old_port, old, "sender evicted from the peer cache (least recently used)"
            )
        sock = self._ctx.socket(zmq.DEALER)  # raises ZMQError, e.g. at libzmq's socket limit
        try:
            sock.setsockopt(zmq.LINGER, config.linger_ms)
            sock.setsockopt(zmq.SNDHWM, config.send_hwm)
            sock.setsockopt(zmq.SNDTIMEO, int(config.send_timeout_s * 1000))
            # Queue only on completed connections: a dead peer surfaces as a send
            # timeout instead of messages silently piling up inside libzmq.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            set_keepalive(sock, config)
            if config.curve is not None:
                config.curve.apply_client(sock, host)
            sock.connect(tcp_url(host, port, source_for(self._source, host)))
        except BaseException:
            sock.close(linger=0)
            raise
        outbox = Outbox(sock)
        self._boxes[key] = outbox
        self._counts.senders_opened += 1
        return outbox

    def _discard(self, host: str, port: int, outbox: Outbox, reason: str) -> None:
        while outbox.backlog:
            _payload, _deadline, transfer_id, kind = outbox.backlog.popleft()
            self._fail(host, port, transfer_id, kind, reason)
        if outbox.polling:
            self._poller.unregister(outbox.sock)
            outbox.polling = False
        outbox.sock.close(linger=self._config.linger_ms)
