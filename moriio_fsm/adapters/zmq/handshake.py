"""The handshake, both ends: asking a peer's handshake port for its metadata, and answering.

Rules: used by the I/O thread only; every request's future ends exactly once (reply,
bad reply, timeout, socket error or close); a junk request is rejected, never answered.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from ...logs import get_logger
from .config import TransportConfig
from .errors import HandshakeFailedError, WireDecodeError
from .handshake_codec import HANDSHAKE_REQUEST, decode_handshake_reply
from .sockets import bind, server_socket, set_keepalive, tcp_url

if TYPE_CHECKING:
    from .reporting import TransportCounts

__all__ = ["HandshakeRequests", "HandshakeServers"]

log = get_logger("moriio_fsm.adapters.zmq")


@dataclass
class _Pending:
    future: concurrent.futures.Future
    host: str
    port: int
    deadline: float
    frames: list = field(default_factory=list)


class HandshakeRequests:
    """Handshakes this transport started, one DEALER socket each until it ends."""

    def __init__(
        self, ctx: zmq.Context, poller: zmq.Poller, config: TransportConfig, counts: TransportCounts
    ) -> None:
        self._ctx = ctx
        self._poller = poller
        self._config = config
        self._counts = counts
        self._pending: dict[zmq.Socket, _Pending] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __contains__(self, sock: object) -> bool:
        return sock in self._pending

    def start(
        self, host: str, port: int, future: concurrent.futures.Future, deadline: float
    ) -> None:
        """Send the request to ``host:port``; ``future`` gets the ``HandshakeReply`` or the failure."""
        if not future.set_running_or_notify_cancel():
            return
        sock = None
        config = self._config
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, config.limits.max_handshake_bytes)
            set_keepalive(sock, config)
            if config.curve is not None:
                config.curve.apply_client(sock, host)
            sock.connect(tcp_url(host, port))
            sock.send(HANDSHAKE_REQUEST, zmq.NOBLOCK)  # a fresh DEALER queues it until connected
        except Exception as exc:
            if sock is not None:
                sock.close(linger=0)
            self._counts.handshake_failed += 1
            future.set_exception(
                HandshakeFailedError(
                    f"could not start a handshake with {host}:{port}: {type(exc).__name__}: {exc}"
                )
            )
            return
        self._pending[sock] = _Pending(future, host, port, deadline)
        self._poller.register(sock, zmq.POLLIN)

    def collect(self, sock: zmq.Socket) -> None:
        """Read what arrived on ``sock``; once both reply parts are here, end its handshake."""
        pending = self._pending[sock]
        while len(pending.frames) < 2:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2 or parts[0] != b"":
                self.fail(
                    sock,
                    HandshakeFailedError(
                        f"bad handshake reply from {pending.host}:{pending.port}: expected [b'', payload]"
                    ),
                )
                return
            pending.frames.append(parts[1])
        try:
            reply = decode_handshake_reply(*pending.frames, limits=self._config.limits)
        except WireDecodeError as exc:
            self.fail(
                sock,
                HandshakeFailedError(
                    f"bad handshake reply from {pending.host}:{pending.port}: {exc}"
                ),
            )
            return
        self._finish(sock, reply)

    def fail(self, sock: zmq.Socket, error: HandshakeFailedError) -> None:
        """End the handshake on ``sock`` with ``error``."""
        self._counts.handshake_failed += 1
        self._finish(sock, error)

    def expire(self, now: float) -> None:
        """Fail every handshake whose deadline has passed."""
        for sock, pending in list(self._pending.items()):
            if pending.deadline <= now:
                self.fail(
                    sock,
                    HandshakeFailedError(
                        f"no handshake reply from {pending.host}:{pending.port} in time"
                    ),
                )

    def close(self) -> None:
        for sock in list(self._pending):
            self.fail(sock, HandshakeFailedError("transport closed"))

    def _finish(self, sock: zmq.Socket, outcome: object) -> None:
        pending = self._pending.pop(sock)
        self._poller.unregister(sock)
        sock.close(linger=0)
        if isinstance(outcome, BaseException):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)


class HandshakeServers:
    """Handshake ports this transport serves, each answering with its encoded reply.

    ``reject(identity, error)`` is told of every malformed request.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        poller: zmq.Poller,
        config: TransportConfig,
        counts: TransportCounts,
        reject: Callable[[bytes, WireDecodeError], None],
    ) -> None:
        self._ctx = ctx
        self._poller = poller
        self._config = config
        self._counts = counts
        self._reject = reject
        self._replies: dict[zmq.Socket, tuple[bytes, bytes]] = {}

    def __contains__(self, sock: object) -> bool:
        return sock in self._replies

    def start(
        self, host: str, port: int, frames: tuple[bytes, bytes], future: concurrent.futures.Future
    ) -> None:
        """Bind a handshake port on ``host:port``; ``future`` gets the port or the bind's error."""
        if not future.set_running_or_notify_cancel():
            return  # the caller gave up waiting; do not bind a port nobody knows about
        try:
            # A request is one short frame: 4 KiB is plenty and keeps floods cheap.
            sock = server_socket(self._ctx, self._config, zmq.ROUTER, 4096)
            try:
                bound = bind(sock, host, port)
            except BaseException:
                sock.close(linger=0)
                raise
        except Exception as exc:
            future.set_exception(exc)
            return
        self._replies[sock] = frames
        self._poller.register(sock, zmq.POLLIN)
        future.set_result(bound)

    def answer(self, sock: zmq.Socket) -> None:
        """Answer up to ``config.max_batch`` requests waiting on ``sock``."""
        metadata, layers = self._replies[sock]
        for _ in range(self._config.max_batch):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2 or parts[1] != HANDSHAKE_REQUEST:
                self._reject(
                    parts[0],
                    WireDecodeError(
                        "<frame>", f"expected the handshake request {HANDSHAKE_REQUEST!r}"
                    ),
                )
                continue
            try:
                sock.send_multipart([parts[0], b"", metadata], zmq.NOBLOCK)
                sock.send_multipart([parts[0], b"", layers], zmq.NOBLOCK)
                self._counts.handshakes_served += 1
            except zmq.ZMQError as exc:
                log.warning("zmq.handshake_reply_failed", reason=str(exc))

    def close(self) -> None:
        for sock in list(self._replies):
            sock.close(linger=0)
        self._replies.clear()
