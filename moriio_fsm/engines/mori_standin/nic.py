"""The target half of the stand-in's "NIC": a TCP listener on an RDMA engine's host:port that lets engines of
other processes write into and read from this engine's registered regions, as one-sided RDMA would.

Rules: a request touches only a region that is registered now, exactly as the initiator's descriptor names it
(id, address, size), and only ranges inside it, copied under the region table's lock so that a region
deregistered first is never touched; whatever breaks the protocol drops that connection alone, logged, and the
listener goes on; at most ``MAX_CONNECTIONS`` peers at once, each dropped after ``IDLE_S`` of silence; ``close``
ends the listener and every connection.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
from collections.abc import Callable

from .mover import Region, RegionTable
from .wire import OP_WRITE, FrameError, Reply, Request, read_request, recv_exact, reply_bytes

__all__ = ["MAX_CONNECTIONS", "NicListener"]

_log = logging.getLogger("moriio_fsm.engines.mori_standin")

MAX_CONNECTIONS = 64
#: A peer silent this long is dropped (it dials again when it has work), so idle or hostile
#: connections cannot hold every slot for ever.
IDLE_S = 120.0
_ERR_RDMA_OP = 13
_ACCEPT_POLL_S = 0.5


class NicListener:
    """Serves ``regions`` of the engine ``engine_key`` at ``host``:``port`` (0: a free port, see ``port``).

    ``on_inbound(initiator_key, uid)`` is told of every write that landed with a notification asked for.
    Raises ``OSError`` when the address cannot be bound.
    """

    def __init__(
        self,
        engine_key: str,
        host: str,
        port: int,
        regions: RegionTable,
        on_inbound: Callable[[str, int], None],
    ) -> None:
        self._key = engine_key
        self._regions = regions
        self._on_inbound = on_inbound
        self._server = socket.create_server((host, port), backlog=MAX_CONNECTIONS)
        self._server.settimeout(_ACCEPT_POLL_S)
        self.port: int = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        threading.Thread(
            target=self._accept_loop, name=f"mori-standin-nic-{self.port}", daemon=True
        ).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections), set()
        self._server.close()
        for connection in connections:
            _shut(connection)

    # -- accepting ---------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                connection, peer = self._server.accept()
            except TimeoutError:
                if self._closed:
                    return
                continue
            except OSError:
                return  # closed
            if not self._admit(connection):
                _log.warning(
                    "[mori stand-in] NIC of %r refused a connection from %s: %d peers already",
                    self._key,
                    peer,
                    MAX_CONNECTIONS,
                )
                _shut(connection)
                continue
            threading.Thread(
                target=self._serve,
                args=(connection, peer),
                name="mori-standin-nic-peer",
                daemon=True,
            ).start()

    def _admit(self, connection: socket.socket) -> bool:
        with self._lock:
            if self._closed or len(self._connections) >= MAX_CONNECTIONS:
                return False
            connection.settimeout(IDLE_S)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connections.add(connection)
            return True

    # -- serving one peer ----------------------------------------------------------------------------

    def _serve(self, connection: socket.socket, peer) -> None:
        try:
            while True:
                request = read_request(connection)
                size = request.payload_size if request.op == OP_WRITE else 0
                payload = recv_exact(connection, size)
                connection.sendall(reply_bytes(self._answer(request, payload)))
        except FrameError as exc:
            _log.warning("[mori stand-in] NIC dropped a connection from %s: %s", peer, exc)
        except (ConnectionError, OSError):
            pass  # the peer left, or close() shut it
        except Exception:  # one peer's trouble must never end the listener
            _log.exception("[mori stand-in] NIC: serving %s raised; connection dropped", peer)
        finally:
            with self._lock:
                self._connections.discard(connection)
            _shut(connection)

    def _answer(self, request: Request, payload: bytearray) -> Reply:
        if request.target_key != self._key:
            return Reply(
                _ERR_RDMA_OP,
                f"remote access error: no engine {request.target_key!r} here (stand-in)",
            )
        named = Region(request.mem_id, request.address, request.size)
        with self._regions.lock:
            if self._regions.current(request.mem_id) != named:
                return Reply(
                    _ERR_RDMA_OP,
                    "remote access error: the remote memory region is not registered (stand-in)",
                )
            if any(offset + size > named.size for offset, size in request.ranges):
                return Reply(
                    _ERR_RDMA_OP, "remote access error: a range lies outside the region (stand-in)"
                )
            if request.op == OP_WRITE:
                _scatter(named.address, request.ranges, payload)
            else:
                return Reply(0, "", _gather(named.address, request.ranges))
        if request.notify:
            self._on_inbound(request.initiator_key, request.uid)
        return Reply(0, "")


def _scatter(base: int, ranges: list[tuple[int, int]], payload: bytearray) -> None:
    if not payload:
        return
    start = ctypes.addressof((ctypes.c_char * len(payload)).from_buffer(payload))
    at = 0
    for offset, size in ranges:
        ctypes.memmove(base + offset, start + at, size)
        at += size


def _gather(base: int, ranges: list[tuple[int, int]]) -> bytes:
    return b"".join(ctypes.string_at(base + offset, size) for offset, size in ranges)


def _shut(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    connection.close()
