"""The initiator half of the stand-in's "NIC": moves a batch to or from an engine of another process (or host)
over TCP to that engine's listener (``nic.py``), one connection per remote engine address, reused.

Rules: the local region is read or written only while it is registered, under its table's lock; a peer that
refuses, resets or does not answer within ``reply_timeout_s()`` is unreachable (mori's "transport retry counter
exceeded": the status fails with ERR_RDMA_OP and the engine records a peer failure); a connection that broke is
dropped and the next batch dials again; a reused connection that turns out dead is redialled once.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading

from .mover import Problem, Region, RegionTable, RemoteRegion
from .wire import OP_READ, OP_WRITE, FrameError, Request, read_reply, request_bytes

__all__ = ["SocketMover", "reply_timeout_s"]

_CONNECT_TIMEOUT_S = 5.0
_DEFAULT_REPLY_TIMEOUT_S = 10.0


def reply_timeout_s() -> float:
    """How long a batch waits for the remote NIC (``MORI_STANDIN_REPLY_TIMEOUT_S``, default 10 s): RDMA's
    retransmission budget, after which a silent peer counts as gone."""
    raw = os.environ.get("MORI_STANDIN_REPLY_TIMEOUT_S", "")
    try:
        value = float(raw) if raw else _DEFAULT_REPLY_TIMEOUT_S
    except ValueError:
        raise ValueError(
            f"MORI_STANDIN_REPLY_TIMEOUT_S must be a number of seconds, got {raw!r}"
        ) from None
    if not 0 < value < float("inf"):
        raise ValueError(
            f"MORI_STANDIN_REPLY_TIMEOUT_S must be a positive finite number, got {raw!r}"
        )
    return value


class _Connections:
    """Open connections by remote address; each is used by one batch at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], socket.socket] = {}

    def take(self, address: tuple[str, int]) -> tuple[socket.socket, bool]:
        """A connection to ``address`` (reused: True) that the caller owns until ``give_back``."""
        with self._lock:
            connection = self._open.pop(address, None)
        if connection is not None:
            return connection, True
        connection = socket.create_connection(address, timeout=_CONNECT_TIMEOUT_S)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection, False

    def give_back(self, address: tuple[str, int], connection: socket.socket) -> None:
        with self._lock:
            spare = self._open.pop(address, None)
            self._open[address] = connection
        if spare is not None:
            spare.close()


_CONNECTIONS = _Connections()


class SocketMover:
    """Moves ranges to or from a region of an engine reached through its listener at (host, port)."""

    def move(self, op, local, local_table, remote, ranges, notify_as=None):
        payload = b""
        if op == "write":
            payload = _copy_out(local, local_table, ranges)
            if payload is None:
                return _LOCAL_GONE
        reply = _exchange(remote, _request(op, remote, ranges, notify_as), payload)
        if isinstance(reply, Problem):
            return reply
        if reply.code != 0:
            return Problem(reply.message or f"remote NIC answered code {reply.code} (stand-in)")
        return _copy_in(local, local_table, ranges, reply.payload) if op == "read" else None


_LOCAL_GONE = Problem(
    "local protection error: the local memory region is not registered (stand-in)"
)


def _request(op: str, remote: RemoteRegion, ranges, notify_as: tuple[str, int] | None) -> Request:
    region = remote.region
    initiator, uid = notify_as or ("", 0)
    return Request(
        op=OP_WRITE if op == "write" else OP_READ,
        notify=notify_as is not None,
        uid=uid,
        mem_id=region.mem_id,
        address=region.address,
        size=region.size,
        target_key=remote.engine_key,
        initiator_key=initiator,
        ranges=[(remote_offset, size) for _, remote_offset, size in ranges],
    )


def _exchange(remote: RemoteRegion, request: Request, payload: bytes):
    address = (remote.host or "127.0.0.1", remote.port)
    for attempt in (1, 2):
        try:
            connection, reused = _CONNECTIONS.take(address)
        except OSError as exc:
            return _unreachable(remote, f"cannot connect ({exc.strerror or exc})")
        try:
            connection.settimeout(reply_timeout_s())
            connection.sendall(b"".join(request_bytes(request, payload)))
            reply = read_reply(connection)
        except (OSError, ConnectionError, FrameError) as exc:
            connection.close()
            if reused and attempt == 1 and not isinstance(exc, TimeoutError):
                continue  # the spare connection died while idle: dial once more
            why = "no answer in time" if isinstance(exc, TimeoutError) else str(exc)
            return _unreachable(remote, why)
        _CONNECTIONS.give_back(address, connection)
        return reply
    return _unreachable(remote, "the connection broke twice")


def _unreachable(remote: RemoteRegion, why: str) -> Problem:
    return Problem(
        f"transport retry counter exceeded: engine {remote.engine_key!r} at {remote.host}:{remote.port} "
        f"does not answer: {why} (stand-in)",
        peer_unreachable=True,
    )


def _copy_out(local: Region, table: RegionTable, ranges) -> bytes | None:
    with table.lock:
        if table.current(local.mem_id) != local:
            return None
        return b"".join(
            ctypes.string_at(local.address + offset, size) for offset, _, size in ranges
        )


def _copy_in(local: Region, table: RegionTable, ranges, payload: bytes) -> Problem | None:
    expected = sum(size for _, _, size in ranges)
    if len(payload) != expected:
        return Problem(
            f"remote NIC answered {len(payload)} bytes for a read of {expected} (stand-in)"
        )
    with table.lock:
        if table.current(local.mem_id) != local:
            return _LOCAL_GONE
        at = 0
        for offset, _, size in ranges:
            ctypes.memmove(local.address + offset, payload[at : at + size], size)
            at += size
    return None
