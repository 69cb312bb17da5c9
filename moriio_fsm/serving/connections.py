"""The proxy's connection guard: at most ``max_connections`` open at once, and a deadline for
each request's head (its request line and headers).

Rules: a connection over the cap is answered 503 naming the cap and closed, never queued; a
connection that has sent no complete head ``header_timeout_s`` after it opened or after its
last answer is closed (that also ends an idle keep-alive connection, which is not counted);
refusals and heads too slow are counted, not logged one by one. It wraps the HTTP protocol uvicorn would pick, through asyncio's
``Protocol`` interface only; ``middleware`` tells it when a request is being served.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

#: How long a refused connection may take to finish sending its head before the 503 goes
#: out: answering before the request is read would make the close reset the connection,
#: and the client could lose the answer.
REFUSE_GRACE_S = 1.0
#: Enough of a head to find its end in (a longer one is answered all the same).
HEAD_END = b"\r\n\r\n"

Peer = tuple[str, int]


def peer_of(transport: asyncio.BaseTransport) -> Peer | None:
    """The client's (host, port), as uvicorn puts it in the ASGI scope's ``client``."""
    sock = transport.get_extra_info("socket")
    try:
        info = sock.getpeername() if sock is not None else transport.get_extra_info("peername")
    except OSError:
        return None
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


def refusal(max_connections: int) -> bytes:
    """The whole HTTP answer a connection over the cap gets."""
    body = json.dumps(
        {
            "error": {
                "message": f"the proxy has max_connections={max_connections} connections open; "
                "try again shortly",
                "type": "service_unavailable",
                "transfer_id": None,
            }
        }
    ).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """The cap, the head deadline and their counts, shared by every connection of a server."""

    def __init__(self, max_connections: int, header_timeout_s: float):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open: set[GuardedConnection] = set()
        self.by_peer: dict[Peer, GuardedConnection] = {}
        self.counts = {"refused": 0, "header_timeouts": 0}

    def describe(self) -> dict[str, int]:
        """What ``GET /health`` shows under ``connections``."""
        return {"open": len(self.open), "max": self.max_connections, **self.counts}

    def protocol_factory(
        self, inner: Callable[..., asyncio.Protocol]
    ) -> Callable[..., asyncio.Protocol]:
        """What uvicorn's ``http`` option takes: ``inner``'s protocol, guarded."""

        def make(*args: Any, **kwargs: Any) -> GuardedConnection:
            return GuardedConnection(self, inner(*args, **kwargs))

        return make

    def middleware(self, app):
        """``app`` (ASGI), telling each connection when one of its requests is being served."""

        async def guarded(scope, receive, send):
            connection = None
            if scope["type"] == "http" and scope.get("client"):
                client = scope["client"]
                connection = self.by_peer.get((str(client[0]), int(client[1])))
            if connection is not None:
                connection.request_started()
            try:
                await app(scope, receive, send)
            finally:
                if connection is not None:
                    connection.request_ended()

        return guarded


class GuardedConnection(asyncio.Protocol):
    """One client connection: refused over the cap, else handed to ``inner`` under a head deadline."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None
        self.refusing = False
        self.timer: asyncio.TimerHandle | None = None
        self.served = 0  # requests answered on this connection
        self.head_begun = False  # bytes came since the last answer (or the opening)
        self.seen = b""  # the last bytes of a refused connection's head

    # -- asyncio's Protocol interface ------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        guard = self.guard
        if len(guard.open) >= guard.max_connections:
            self.refusing = True
            guard.counts["refused"] += 1
            self._after(min(REFUSE_GRACE_S, guard.header_timeout_s), self._refuse)
            return
        guard.open.add(self)
        self.peer = peer_of(transport)
        if self.peer is not None:  # else no request of it could stop the deadline
            guard.by_peer[self.peer] = self
            self._after(guard.header_timeout_s, self._head_too_slow)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.refusing:
            self.head_begun = self.head_begun or self.timer is not None
            self.inner.data_received(data)
            return
        window = self.seen + data
        if HEAD_END in window:
            self._refuse()
        self.seen = window[-len(HEAD_END) :]

    def eof_received(self) -> bool | None:
        if self.refusing:
            self._refuse()
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self.refusing:
            return
        self.guard.open.discard(self)
        if self.peer is not None and self.guard.by_peer.get(self.peer) is self:
            del self.guard.by_peer[self.peer]
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self.refusing:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refusing:
            self.inner.resume_writing()

    # -- the head deadline -------------------------------------------------------------------------

    def request_started(self) -> None:
        self._cancel()
        self.head_begun = False

    def request_ended(self) -> None:
        self.served += 1
        if self.transport is not None and not self.transport.is_closing() and self.peer is not None:
            self._after(self.guard.header_timeout_s, self._head_too_slow)

    def _head_too_slow(self) -> None:
        self.timer = None
        if self.transport is not None and not self.transport.is_closing():
            if self.head_begun or not self.served:  # not a keep-alive connection at rest
                self.guard.counts["header_timeouts"] += 1
            self.transport.close()

    def _refuse(self) -> None:
        self._cancel()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(refusal(self.guard.max_connections))
            self.transport.close()

    def _after(self, delay_s: float, then: Callable[[], None]) -> None:
        self._cancel()
        self.timer = asyncio.get_running_loop().call_later(delay_s, then)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
