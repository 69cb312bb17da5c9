"""The frames the stand-in's "NIC" exchanges over TCP to reach another process's registered memory.

Rules: one request (a batch of ranges into one remote region) gets one reply, in order on a connection; every
number is big-endian and bounded before anything is allocated for it (ranges, key lengths, payload); a frame that
breaks a rule raises ``FrameError`` naming the field, so the listener drops that connection and nothing else.
This is the stand-in's own protocol, not mori's (native mori speaks RDMA verbs here).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

__all__ = [
    "FrameError",
    "MAX_PAYLOAD",
    "MAX_RANGES",
    "OP_READ",
    "OP_WRITE",
    "Reply",
    "Request",
    "read_reply",
    "read_request",
    "recv_exact",
    "reply_bytes",
    "request_bytes",
]

OP_WRITE, OP_READ = 1, 2
MAX_RANGES = 1 << 16
MAX_KEY = 1024
MAX_MESSAGE = 4096
MAX_PAYLOAD = (
    1 << 30
)  # what one batch may move: far above a request's KV, far below this host's memory

_REQUEST = struct.Struct(
    "!4sBB2xQIQQIHH"
)  # magic, op, notify, uid, mem id, address, size, ranges, keys
_RANGE = struct.Struct("!QQ")  # remote offset, size
_REPLY = struct.Struct("!4sB1xHQ")  # magic, code, message length, payload length
_REQUEST_MAGIC, _REPLY_MAGIC = b"MSQ1", b"MSR1"


class FrameError(ValueError):
    """A frame that breaks the protocol; the message names the field and what was expected."""


@dataclass(frozen=True)
class Request:
    """One batch for the target: the region it names (as the initiator's descriptor says) and the ranges."""

    op: int
    notify: bool
    uid: int
    mem_id: int
    address: int
    size: int
    target_key: str
    initiator_key: str
    ranges: list[tuple[int, int]]  # (remote offset, size)

    @property
    def payload_size(self) -> int:
        return sum(size for _, size in self.ranges)


@dataclass(frozen=True)
class Reply:
    code: int
    message: str
    payload: bytes = b""


def request_bytes(request: Request, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """The frame of ``request`` as buffers to send in order (a write's payload last, not copied)."""
    target, initiator = request.target_key.encode(), request.initiator_key.encode()
    head = _REQUEST.pack(
        _REQUEST_MAGIC,
        request.op,
        int(request.notify),
        request.uid,
        request.mem_id,
        request.address,
        request.size,
        len(request.ranges),
        len(target),
        len(initiator),
    )
    ranges = b"".join(_RANGE.pack(offset, size) for offset, size in request.ranges)
    return (
        [head + target + initiator + ranges, payload]
        if payload
        else [head + target + initiator + ranges]
    )


def reply_bytes(reply: Reply) -> bytes:
    message = reply.message.encode()[:MAX_MESSAGE]
    return (
        _REPLY.pack(_REPLY_MAGIC, reply.code, len(message), len(reply.payload))
        + message
        + reply.payload
    )


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    """``size`` bytes from ``sock``; ``ConnectionError`` when the peer closes first."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {size} bytes")
        got += n
    return buffer


def read_request(sock: socket.socket) -> Request:
    """The next request's header, keys and ranges (a write's payload is still to be read)."""
    fields = _REQUEST.unpack(recv_exact(sock, _REQUEST.size))
    magic, op, notify, uid, mem_id, address, size, count, target_len, initiator_len = fields
    _expect(magic == _REQUEST_MAGIC, "magic", f"{_REQUEST_MAGIC!r}", magic)
    _expect(op in (OP_WRITE, OP_READ), "op", "1 (write) or 2 (read)", op)
    _expect(notify in (0, 1), "notify", "0 or 1", notify)
    _expect(count <= MAX_RANGES, "range count", f"at most {MAX_RANGES}", count)
    _expect(target_len <= MAX_KEY, "target key length", f"at most {MAX_KEY}", target_len)
    _expect(initiator_len <= MAX_KEY, "initiator key length", f"at most {MAX_KEY}", initiator_len)
    keys = bytes(recv_exact(sock, target_len + initiator_len))
    raw = recv_exact(sock, count * _RANGE.size)
    ranges = [_RANGE.unpack_from(raw, i * _RANGE.size) for i in range(count)]
    request = Request(
        op, bool(notify), uid, mem_id, address, size,
        _text(keys[:target_len], "target key"), _text(keys[target_len:], "initiator key"), ranges,
    )  # fmt: skip
    _expect(
        request.payload_size <= MAX_PAYLOAD,
        "payload size",
        f"at most {MAX_PAYLOAD}",
        request.payload_size,
    )
    return request


def read_reply(sock: socket.socket) -> Reply:
    magic, code, message_len, payload_len = _REPLY.unpack(recv_exact(sock, _REPLY.size))
    _expect(magic == _REPLY_MAGIC, "reply magic", f"{_REPLY_MAGIC!r}", magic)
    _expect(
        message_len <= MAX_MESSAGE, "reply message length", f"at most {MAX_MESSAGE}", message_len
    )
    _expect(
        payload_len <= MAX_PAYLOAD, "reply payload length", f"at most {MAX_PAYLOAD}", payload_len
    )
    message = _text(bytes(recv_exact(sock, message_len)), "reply message")
    return Reply(code, message, bytes(recv_exact(sock, payload_len)) if payload_len else b"")


def _text(raw: bytes, field: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise FrameError(f"{field}: expected UTF-8 text ({exc.reason})") from None


def _expect(ok: bool, field: str, expected: str, got: object) -> None:
    if not ok:
        raise FrameError(f"{field}: expected {expected}, got {got!r}")
