"""What the ZeroMQ transport's I/O thread runs: the sockets opened, the poll loop, the commands
other threads queued, send failures reported, and the shutdown that fails whatever is left.

Rules: this code runs on the I/O thread only; an error while serving one socket or one command
is contained to it; every shutdown step runs, and everything still queued is failed, never kept.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ...logs import get_logger
from .config import TransportConfig
from .errors import HandshakeFailedError, TransportClosedError, WireDecodeError
from .handshake import HandshakeRequests, HandshakeServers
from .outbox import Outboxes
from .policy import PeerPolicy, canonical_host
from .receiver import NotifyReceiver, Peer
from .reporting import LogLimiter, TransportCounts
from .senders import AddressCache
from .sockets import bind, server_socket
from .zap import ZapHandler

__all__ = ["IoThread", "SendFailure"]

log = get_logger("moriio_fsm.adapters.zmq")


@dataclass(frozen=True, slots=True)
class SendFailure:
    """A message that was accepted by ``send`` but could not be delivered."""

    host: str
    port: int
    transfer_id: str | None
    kind: str
    reason: str


def _is_loopback(host: str) -> bool:
    try:
        canonical = canonical_host(host)
    except ValueError:
        return False
    return canonical == "localhost" if isinstance(canonical, str) else canonical.is_loopback


class IoThread:
    """The I/O thread's part of ``ZmqTransport`` (a base class of it): ``_run`` is the thread."""

    config: TransportConfig
    policy: PeerPolicy
    counts: TransportCounts
    bind_host: str
    notify_port: int | None
    _closed: bool
    _on_send_failure: Callable[[SendFailure], None] | None
    _commands: collections.deque
    _sends: collections.deque
    _wake_pending: bool
    _wake_read: int
    _log_limiter: LogLimiter
    _receiver: NotifyReceiver
    _ctx: zmq.Context
    _poller: zmq.Poller
    _addresses: AddressCache
    _outboxes: Outboxes
    _handshakes: HandshakeRequests
    _handshake_servers: HandshakeServers
    _listener: zmq.Socket | None
    _zap: ZapHandler | None
    _authorized: frozenset[bytes]

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
