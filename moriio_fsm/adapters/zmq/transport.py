"""The ZeroMQ transport: the public ``ZmqTransport`` API and the one I/O thread that owns every socket.

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
from dataclasses import dataclass
from typing import Union

import zmq

from ...logs import get_logger
from .codec import HandshakeReply, NotifyMessage, encode_handshake_reply, encode_notify
from .config import TransportConfig
from .errors import HandshakeFailedError, TransportBusyError, TransportClosedError, WireDecodeError
from .handshake import HandshakeRequests, HandshakeServers
from .hosts import default_bind_host
from .outbox import Outboxes
from .policy import PeerPolicy, canonical_host
from .ports import RankEndpoint
from .receiver import Delivery, NotifyReceiver, Peer
from .reporting import LogLimiter, TransportCounts
from .senders import AddressCache
from .sockets import bind, server_socket
from .zap import ZapHandler

__all__ = [
    "Delivery",
    "Peer",
    "SendFailure",
    "ZmqTransport",
]

log = get_logger("moriio_fsm.adapters.zmq")

Destination = Union[RankEndpoint, "tuple[str, int]"]


def _is_loopback(host: str) -> bool:
    try:
        canonical = canonical_host(host)
    except ValueError:
        return False
    return canonical == "localhost" if isinstance(canonical, str) else canonical.is_loopback


@dataclass(frozen=True, slots=True)
class SendFailure:
    """A message that was accepted by ``send`` but could not be delivered."""

    host: str
    port: int
    transfer_id: str | None
    kind: str
    reason: str


class ZmqTransport:
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

    # ------------------------------------------------------------------ I/O thread

    def _run(self, started: threading.Event, failure: list) -> None:
        try:
            self._open_sockets()
        except BaseException as exc:  # reported to the constructor
            failure.append(exc)
            self._closed = True
            self._close_sockets()
            started.set()
            return
        started.set()
        try:
            self._loop()
        except BaseException:
            log.exception("zmq.io_thread_crashed")
        finally:
            # Refuse new work first, then fail what is queued: a caller that
            # appends after this point sees _closed and takes its item back.
            self._closed = True
            self._close_sockets()

    def _open_sockets(self) -> None:
        cfg = self.config
        self._poller.register(self._wake_read, zmq.POLLIN)
        # Bound before any server socket, so no peer is ever let in unchecked.
        self._zap = ZapHandler(
            self._ctx,
            self._poller,
            self._authorized if cfg.curve is not None else None,
            self.counts,
            self._log_limiter,
            admits=self._admits,
        )
        if cfg.listen:
            sock = server_socket(self._ctx, cfg, zmq.ROUTER, cfg.limits.max_message_bytes)
            self.notify_port = bind(sock, self.bind_host, cfg.notify_port)
            self._listener = sock
            self._poller.register(sock, zmq.POLLIN)
            log.info(
                "zmq.listening",
                host=self.bind_host,
                port=self.notify_port,
                role=cfg.role.value,
                curve=cfg.curve is not None,
            )
            if cfg.curve is None and not _is_loopback(self.bind_host):
                log.warning(
                    "zmq.listening_without_curve",
                    host=self.bind_host,
                    port=self.notify_port,
                    exposure="anyone who can reach this address can send this listener "
                    "control messages; a transfer takes them only from the host "
                    "its request named, so a host that can forge that address can "
                    "still end or fail its transfers; turn on 'curve' to "
                    "authenticate peers by key",
                )

    def _loop(self) -> None:
        poller = self._poller
        listener = self._listener
        zap = self._zap
        outboxes, handshakes, servers = self._outboxes, self._handshakes, self._handshake_servers
        next_expiry_check = 0.0
        while True:
            # Poll briefly while something waits on a deadline, so it is checked in time.
            timeout_ms = 25 if handshakes or outboxes.polling else 1000
            for target, flags in poller.poll(timeout_ms):
                try:
                    if target is listener:
                        self._receiver.drain(listener)
                    elif target == self._wake_read:
                        if self._drain_commands():
                            return
                    elif zap is not None and target is zap.socket:
                        zap.serve()
                    elif target in handshakes:
                        handshakes.collect(target)
                    elif target in servers:
                        servers.answer(target)
                    elif flags & zmq.POLLOUT:
                        outboxes.flush(target)
                except Exception as exc:
                    self._io_error(target, exc)
            now = time.monotonic()
            if now >= next_expiry_check:
                next_expiry_check = now + 0.025
                try:
                    outboxes.expire(now)
                    handshakes.expire(now)
                except Exception as exc:
                    self._io_error(None, exc)

    def _io_error(self, target: zmq.Socket | int | None, exc: Exception) -> None:
        """An unexpected error while serving one socket (or the wake pipe's descriptor):
        contain it to that socket."""
        self.counts.io_errors += 1
        if isinstance(target, zmq.Socket) and target in self._handshakes:
            self._handshakes.fail(target, HandshakeFailedError(f"handshake socket error: {exc}"))
        if self._log_limiter.allow(time.monotonic()):
            log.error("zmq.io_error", error=f"{_type_name(exc)}: {exc}", exc_info=exc)

    # commands ---------------------------------------------------------------

    def _drain_commands(self) -> bool:
        # Order matters: empty the pipe, then clear the flag, then drain.  A caller
        # that appends after the flag is cleared writes the pipe again; clearing
        # before reading could swallow that byte and leave the flag set for good.
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        self._wake_pending = False
        if self._sends:
            self._outboxes.send_queued(self._sends)
        commands = self._commands
        while commands:
            command = commands.popleft()
            op = command[0]
            if op == "stop":
                return True  # whatever is still queued is failed by _close_sockets
            try:
                if op == "handshake":
                    self._handshakes.start(*command[1:])
                elif op == "serve":
                    self._handshake_servers.start(*command[1:])
            except Exception as exc:
                self.counts.io_errors += 1
                log.error("zmq.command_failed", command=op, error=f"{_type_name(exc)}: {exc}")
                self._fail_command(command, exc)
        return False

    @staticmethod
    def _fail_command(command: tuple, exc: BaseException) -> None:
        """Fail the future of a handshake or serve command that was not carried out."""
        op = command[0]
        if op == "handshake":
            future = command[3]
            if not isinstance(exc, HandshakeFailedError):
                exc = HandshakeFailedError(
                    f"handshake with {command[1]}:{command[2]} failed: {exc}"
                )
        elif op == "serve":
            future = command[4]
        else:
            return
        if future.done():
            return
        if future.running() or future.set_running_or_notify_cancel():
            future.set_exception(exc)

    # send failures ----------------------------------------------------------

    def _fail(self, host: str, port: int, transfer_id: str | None, kind: str, reason: str) -> None:
        self.counts.send_failed += 1
        log.warning(
            "zmq.send_failed",
            peer=f"{host}:{port}",
            transfer_id=transfer_id,
            kind=kind,
            reason=reason,
        )
        if self._on_send_failure is not None:
            try:
                self._on_send_failure(SendFailure(host, port, transfer_id, kind, reason))
            except Exception:
                self.counts.callback_errors += 1
                log.exception("zmq.send_failure_callback_raised")

    # receiving --------------------------------------------------------------

    def _admits(self, address: str) -> bool:
        """ZAP's question, on the I/O thread: may a connection from ``address`` come in?"""
        return self.policy.admits_address(address, self._addresses.addresses)

    def _reject_handshake_request(self, identity: bytes, error: WireDecodeError) -> None:
        self._receiver.reject(Peer(identity, None), error)

    # shutdown ---------------------------------------------------------------

    def _close_sockets(self) -> None:
        """Close every socket, then fail everything still queued; each step runs
        even if an earlier one raised, so no caller is left waiting."""
        steps = (
            self._outboxes.close,
            self._handshakes.close,
            self._close_servers,
            self._destroy_context,
            self._fail_queued,
        )
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("zmq.shutdown_step_failed", step=step.__qualname__)

    def _close_servers(self) -> None:
        self._handshake_servers.close()
        if self._listener is not None:
            self._listener.close(linger=0)
        if self._zap is not None:
            self._zap.close()

    def _destroy_context(self) -> None:
        # Outboxes were closed with a linger, so this waits at most that long for
        # queued messages to leave; any socket a failed step left open is closed
        # here, so it cannot make the wait endless.
        self._ctx.destroy()

    def _fail_queued(self) -> None:
        # Anything a racing caller appended after "stop" is failed, not lost.
        sends, commands = self._sends, self._commands
        while True:
            try:
                host, port, _payload, transfer_id, kind = sends.popleft()
            except IndexError:
                break
            self._fail(host, port, transfer_id, kind, "transport closed")
        while True:
            try:
                command = commands.popleft()
            except IndexError:
                break
            if command[0] == "handshake":
                self._fail_command(command, HandshakeFailedError("transport closed"))
            else:
                self._fail_command(command, TransportClosedError("transport is closed"))


def _type_name(value: object) -> str:
    return type(value).__name__
