"""The ZeroMQ transport: the public ``ZmqTransport`` API, and how other threads hand work to the one
I/O thread that owns every socket (what that thread runs: ``io_thread.py``).

Rules: sockets live on the I/O thread only; other threads hand it bounded work through
deques and a wake-up pipe; nothing a peer sends and no callback error stops that thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from typing import Union

import zmq

from .config import TransportConfig
from .errors import TransportBusyError, TransportClosedError
from .handshake import HandshakeRequests, HandshakeServers
from .handshake_codec import HandshakeReply, encode_handshake_reply
from .hosts import default_bind_host
from .io_thread import IoThread, SendFailure
from .messages import NotifyMessage
from .notify_encoder import encode_notify
from .outbox import Outboxes
from .policy import PeerPolicy
from .ports import RankEndpoint
from .receiver import Delivery, NotifyReceiver, Peer
from .reporting import LogLimiter, TransportCounts
from .senders import AddressCache
from .zap import ZapHandler

__all__ = [
    "Delivery",
    "Peer",
    "SendFailure",
    "ZmqTransport",
]

Destination = Union[RankEndpoint, "tuple[str, int]"]


class ZmqTransport(IoThread):
    """Listener, senders and handshake endpoints of one rank, served by one thread.

    Any thread may call ``send``, ``request_handshake``, ``serve_handshake`` and
    ``close``; the I/O thread alone creates, uses and closes sockets (ZeroMQ
    sockets are not thread-safe).  Every outbound host passes the ``PeerPolicy``
    before a socket exists.  A bad inbound message is counted, logged and dropped.
    An error while serving one command or one message fails that command's future
    or reports that send, and the thread goes on; if the thread ever stops, for any
    reason, the transport is closed and everything still queued is failed, never
    silently kept.  Every queue and cache is bounded by a ``TransportConfig``
    setting; work beyond a bound is refused at once with ``TransportBusyError`` or
    reported through ``on_send_failure``.

    ``on_message(delivery)`` runs on the I/O thread for every accepted message:
    keep it short (enqueue and return).  ``on_send_failure(failure)`` runs there
    too when a queued message times out, is evicted, cannot get a socket or is
    dropped at close.
    Construction binds the listener and starts the thread, or raises
    (``zmq.ZMQError`` for a bind failure, ``ValueError`` for bad settings).
    """

    def __init__(
        self,
        config: TransportConfig,
        on_message: Callable[[Delivery], None],
        *,
        on_send_failure: Callable[[SendFailure], None] | None = None,
    ) -> None:
        self.config = config
        self.policy = PeerPolicy(config.trusted_peers)
        self._on_send_failure = on_send_failure
        self._commands: collections.deque = collections.deque()  # control: handshake, serve, stop
        self._sends: collections.deque = (
            collections.deque()
        )  # (host, port, payload, transfer_id, kind)
        self._wake_pending = False
        self._closed = False  # set once, by close() or when the I/O thread stops
        self._handshake_slots = threading.BoundedSemaphore(config.max_pending_handshakes)
        # Held while writing the wake pipe and while closing it, so a late wake-up
        # never writes to a closed descriptor number that the process has reused.
        self._wake_lock = threading.Lock()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self.counts = TransportCounts()
        self._log_limiter = LogLimiter()
        self._receiver = NotifyReceiver(config, self.counts, self._log_limiter, on_message)
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self.bind_host = config.bind_host or default_bind_host()
        self._addresses = AddressCache()  # the trusted names' addresses, for inbound checks
        self._outboxes = Outboxes(
            self._ctx, self._poller, config, self.counts, self._fail, source=self.bind_host
        )
        self._handshakes = HandshakeRequests(self._ctx, self._poller, config, self.counts)
        self._handshake_servers = HandshakeServers(
            self._ctx, self._poller, config, self.counts, self._reject_handshake_request
        )
        self._listener: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self._authorized = config.curve.authorized_raw_keys() if config.curve else frozenset()
        self.notify_port: int | None = None
        started = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run,
            args=(started, failure),
            name=f"moriio-zmq-io-{config.role.value}",
            daemon=True,
        )
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._release_os_resources()
            raise failure[0]

    # ------------------------------------------------------------------ public API

    def send(self, destination: Destination, message: NotifyMessage) -> None:
        """Queue ``message`` for ``destination`` (a ``RankEndpoint`` or ``(host, port)``).

        Safe to call from any thread; never blocks on the network.  Raises at
        once ``UntrustedPeerError`` (the policy refused the host),
        ``WireEncodeError`` (a field is invalid), ``TransportBusyError``
        (``max_queued_sends`` messages are already waiting) or
        ``TransportClosedError``.  Later failures go to ``on_send_failure``.
        """
        host, port = self._destination(destination)
        canonical = self.policy.check(host)
        payload = encode_notify(message, limits=self.config.limits)
        self._enqueue(
            self._sends,
            self.config.max_queued_sends,
            "max_queued_sends",
            (canonical, port, payload, message.transfer_id, message.kind),
        )

    def request_handshake(
        self, destination: Destination, *, timeout_s: float = 10.0
    ) -> concurrent.futures.Future:
        """Ask a peer's handshake port for its metadata; returns a Future of ``HandshakeReply``.

        Raises ``UntrustedPeerError``, ``TransportClosedError`` or
        ``TransportBusyError`` (``max_pending_handshakes`` are queued or in
        flight) at once; the Future fails with ``HandshakeFailedError`` on
        timeout, a bad reply, a socket that cannot be created, or close.
        """
        host, port = self._destination(destination)
        canonical = self.policy.check(host)
        if not self._handshake_slots.acquire(blocking=False):
            raise TransportBusyError(
                f"handshake with {canonical}:{port} refused: {self.config.max_pending_handshakes} handshakes "
                "are already pending (TransportConfig.max_pending_handshakes)"
            )
        future: concurrent.futures.Future = concurrent.futures.Future()
        # Every future ends exactly once (result, failure or cancel): that frees its slot.
        future.add_done_callback(self._release_handshake_slot)
        try:
            self._enqueue(
                self._commands,
                self.config.max_queued_commands,
                "max_queued_commands",
                ("handshake", canonical, port, future, time.monotonic() + timeout_s),
            )
        except BaseException:
            future.cancel()
            raise
        return future

    def serve_handshake(
        self,
        reply: HandshakeReply,
        *,
        port: int = 0,
        bind_host: str | None = None,
        timeout_s: float = 10.0,
    ) -> int:
        """Answer handshake requests on ``port`` (0: ephemeral) with ``reply``; returns the port.

        Raises what the bind raised (``zmq.ZMQError``), ``TransportClosedError``,
        or ``TransportBusyError`` when the I/O thread has not bound the port
        within ``timeout_s`` (the bind is then abandoned).
        """
        frames = encode_handshake_reply(reply)
        host = bind_host or self.bind_host
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(
            self._commands,
            self.config.max_queued_commands,
            "max_queued_commands",
            ("serve", host, port, frames, future),
        )
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if future.cancel():
                raise TransportBusyError(
                    f"serve_handshake on {host}:{port}: the I/O thread did not bind it within {timeout_s}s"
                ) from None
            return future.result(timeout_s)  # the I/O thread is binding it right now

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters: received, delivered, rejected, sent, send_failed ..."""
        return self.counts.as_dict()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the I/O thread and close every socket; idempotent.

        Messages still queued are reported to ``on_send_failure``; pending
        handshakes fail with ``HandshakeFailedError``.  Also releases what is
        left after the I/O thread stopped on its own.
        """
        if not self._closed:
            self._closed = True
            self._commands.append(("stop",))  # never refused: stopping must always get through
            self._wake()
        if threading.current_thread() is self._thread:
            return  # called from a callback: the thread stops after it returns
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._release_os_resources()

    def __enter__(self) -> ZmqTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ caller side

    @staticmethod
    def _destination(destination: Destination) -> tuple[str, int]:
        if type(destination) is not tuple:
            if isinstance(destination, RankEndpoint):
                return destination.host, destination.port
            raise ValueError(
                f"destination: expected a RankEndpoint or (host, port), got {destination!r}"
            )
        host, port = destination
        if type(port) is not int or not 1 <= port <= 65_535:
            raise ValueError(f"port: expected an integer in 1..65535, got {port!r}")
        return host, port

    def _enqueue(self, queue: collections.deque, bound: int, setting: str, item: tuple) -> None:
        """Hand ``item`` to the I/O thread, or raise without queueing it."""
        if self._closed:
            raise TransportClosedError("transport is closed")
        if len(queue) >= bound:
            # Checked without a lock: concurrent callers may overshoot by at most
            # one item each, which keeps the queue bounded.
            raise TransportBusyError(
                f"{bound} items are already waiting for the I/O thread (TransportConfig.{setting}); refused"
            )
        queue.append(item)
        if self._closed:
            # The transport closed while this was being appended, possibly after
            # the I/O thread's last drain.  Take the item back if it is still
            # there (nobody else will handle it) and refuse it; if it is gone, the
            # I/O thread took it and will send it or report it.
            try:
                queue.remove(item)
            except ValueError:
                return
            raise TransportClosedError("transport is closed")
        # One pipe write per batch (see _drain_commands for the ordering that
        # makes this race-free).
        if not self._wake_pending:
            self._wake_pending = True
            self._wake()

    def _release_handshake_slot(self, _future: concurrent.futures.Future) -> None:
        self._handshake_slots.release()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_write < 0:
                return  # closed: nothing is listening any more
            try:
                os.write(self._wake_write, b"\0")
            except OSError:
                pass  # pipe full: the I/O thread is already due to wake

    def _release_os_resources(self) -> None:
        with self._wake_lock:
            for fd in (self._wake_read, self._wake_write):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._wake_read = self._wake_write = -1
