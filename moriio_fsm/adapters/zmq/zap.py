"""The ZAP handler (RFC 27) that admits CURVE clients to this transport's server sockets.

Rules: only the CURVE mechanism with an authorised client key is admitted, and its key (hex)
becomes the connection's user id; a malformed request is refused, never raised; refusals
are counted and their warnings rate-limited.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from ...logs import get_logger
import zmq

if TYPE_CHECKING:
    from .reporting import LogLimiter, TransportCounts

__all__ = ["ZAP_ENDPOINT", "ZapHandler", "zap_reply"]

# Where libzmq sends the authentication requests of every socket in the context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"

log = get_logger("moriio_fsm.adapters.zmq")


def zap_reply(frames: Sequence[bytes], authorized: frozenset[bytes]) -> tuple[list[bytes], str | None]:
    """Answer one ZAP request: ``(reply frames, refusal reason or None)``.

    ``authorized`` holds the admitted client keys as 32-byte binary.
    """
    if len(frames) < 6:
        request_id = frames[1] if len(frames) > 1 else b""
        return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""], "malformed ZAP request"
    version, request_id, _domain, _address, _identity, mechanism = frames[:6]
    credentials = frames[6:]
    if version != b"1.0":
        return [b"1.0", request_id, b"400", b"unsupported ZAP version", b"", b""], "unsupported ZAP version"
    if mechanism != b"CURVE" or len(credentials) != 1:
        return [b"1.0", request_id, b"400", b"CURVE required", b"", b""], f"mechanism {mechanism!r} refused"
    if credentials[0] not in authorized:
        return [b"1.0", request_id, b"400", b"client key not authorised", b"", b""], "client key not authorised"
    # The user id is the client's key in hex: libzmq attaches it to every message of the
    # connection ("User-Id"), so a listener knows which key a message came with.
    return [b"1.0", request_id, b"200", b"OK", credentials[0].hex().encode("ascii"), b""], None


class ZapHandler:
    """The context's ZAP socket, bound at construction and served by the I/O thread."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, authorized: frozenset[bytes],
                 counts: "TransportCounts", limiter: "LogLimiter") -> None:
        self._authorized = authorized  # 32-byte binary keys, as CurveConfig.authorized_raw_keys gives
        self._counts = counts
        self._limiter = limiter
        self.socket = ctx.socket(zmq.REP)
        try:
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.bind(ZAP_ENDPOINT)
            poller.register(self.socket, zmq.POLLIN)
        except BaseException:
            self.socket.close(linger=0)
            raise

    def serve(self) -> None:
        """Answer the waiting authentication request, if any."""
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        reply, refusal = zap_reply(frames, self._authorized)
        if refusal is not None:
            self._counts.auth_refused += 1
            address = frames[3].decode("ascii", "replace") if len(frames) > 3 else None
            if self._limiter.allow(time.monotonic()):
                log.warning("zmq.peer_refused", peer=address, reason=refusal)
        self.socket.send_multipart(reply)

    def close(self) -> None:
        self.socket.close(linger=0)
