"""The ZAP handler (RFC 27) that admits peers to this transport's server sockets.

Rules: every connection to a server socket is asked about before it can send anything: its
address must be one the peer policy trusts, and with CURVE on its mechanism must be CURVE
with an authorised client key, which (hex) becomes the connection's user id; without CURVE
only the NULL mechanism is admitted. A malformed request is refused, never raised;
refusals are counted and their warnings rate-limited.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import zmq

from ...logs import get_logger

if TYPE_CHECKING:
    from .reporting import LogLimiter, TransportCounts

__all__ = ["ZAP_ENDPOINT", "ZapHandler", "zap_reply"]

# Where libzmq sends the authentication requests of every socket in the context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"

log = get_logger("moriio_fsm.adapters.zmq")


def _refuse(request_id: bytes, why: str) -> tuple[list[bytes], str]:
    return [b"1.0", request_id, b"400", why.encode("ascii"), b"", b""], why


def zap_reply(
    frames: Sequence[bytes],
    authorized: frozenset[bytes] | None,
    admits: Callable[[str], bool] = lambda address: True,
) -> tuple[list[bytes], str | None]:
    """Answer one ZAP request: ``(reply frames, refusal reason or None)``.

    ``authorized`` holds the admitted client keys as 32-byte binary, or is None when CURVE is
    off (then the NULL mechanism is the one admitted); ``admits(address)`` says whether the
    connection's address may connect at all.
    """
    if len(frames) < 6:
        return _refuse(frames[1] if len(frames) > 1 else b"", "malformed ZAP request")
    version, request_id, _domain, address, _identity, mechanism = frames[:6]
    credentials = frames[6:]
    if version != b"1.0":
        return _refuse(request_id, "unsupported ZAP version")
    try:
        peer = address.decode("ascii")
    except UnicodeDecodeError:
        return _refuse(request_id, "malformed ZAP request")
    if not admits(peer):
        return _refuse(request_id, "address not trusted")
    if authorized is None:
        if mechanism != b"NULL":
            return _refuse(request_id, f"mechanism {mechanism[:16]!r} refused")
        return [b"1.0", request_id, b"200", b"OK", b"", b""], None
    if mechanism != b"CURVE" or len(credentials) != 1:
        return _refuse(request_id, f"mechanism {mechanism[:16]!r} refused")
    if credentials[0] not in authorized:
        return _refuse(request_id, "client key not authorised")
    # The user id is the client's key in hex: libzmq attaches it to every message of the
    # connection ("User-Id"), so a listener knows which key a message came with.
    return [b"1.0", request_id, b"200", b"OK", credentials[0].hex().encode("ascii"), b""], None


class ZapHandler:
    """The context's ZAP socket, bound at construction and served by the I/O thread."""

    def __init__(
        self,
        ctx: zmq.Context,
        poller: zmq.Poller,
        authorized: frozenset[bytes] | None,
        counts: TransportCounts,
        limiter: LogLimiter,
        admits: Callable[[str], bool] = lambda address: True,
    ) -> None:
        # 32-byte binary keys, as CurveConfig.authorized_raw_keys gives; None: CURVE is off.
        self._authorized = authorized
        self._admits = admits
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
        reply, refusal = zap_reply(frames, self._authorized, self._admits)
        if refusal is not None:
            self._counts.auth_refused += 1
            address = frames[3].decode("ascii", "replace") if len(frames) > 3 else None
            if self._limiter.allow(time.monotonic()):
                log.warning("zmq.peer_refused", peer=address, reason=refusal)
        self.socket.send_multipart(reply)

    def close(self) -> None:
        self.socket.close(linger=0)
