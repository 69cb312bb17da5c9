"""Notify-port frames into typed messages: every field checked against ``WireLimits``.

Rules: only ``WireDecodeError`` (naming field and reason) escapes ``decode_notify``, whatever
the bytes; keys a message does not define are ignored, an unknown ``type`` is refused.
"""

from __future__ import annotations

from .errors import WireDecodeError
from .messages import (
    BARE_RANK,
    RECEIVER,
    Heartbeat,
    LeaseGranted,
    NotifyMessage,
    Release,
    RemoteBlocks,
    Role,
    WireForm,
    WriteDone,
    WriteFailed,
)
from .wire_fields import (
    WHOLE_FRAME,
    check_blocks,
    check_bool,
    check_digest,
    check_id,
    check_int,
    check_reason,
    check_seconds,
    type_name,
)
from .wire_limits import DEFAULT_LIMITS, WireLimits, unpack_bounded

__all__ = ["decode_notify"]

# A structured message is a msgpack map: fixmap, map16 or map32 as its first byte.
_MAP_MARKERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def decode_notify(
    frame: bytes | bytearray | memoryview,
    *,
    role: Role | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
) -> NotifyMessage:
    """Decode one notify-port frame into a typed message.

    ``role`` is the receiving side: messages meant for the other side are
    rejected, and a bare id is read as ``Release`` (producer) or ``WriteDone``
    (consumer).  Without a role every structured message is accepted and a bare
    id is rejected as ambiguous.

    Keys a message does not define are ignored (a newer peer may add some); an
    unknown ``type`` is refused. Raises ``WireDecodeError`` (and nothing else)
    for any frame that is not a valid message within ``limits``.
    """
    try:
        if type(frame) is not bytes:
            if not isinstance(frame, (bytes, bytearray, memoryview)):
                raise WireDecodeError(WHOLE_FRAME, f"expected bytes, got {type_name(frame)}")
            frame = bytes(frame)
        size = len(frame)
        if size == 0:
            raise WireDecodeError(WHOLE_FRAME, "empty message")
        if size > limits.max_message_bytes:
            raise WireDecodeError(
                WHOLE_FRAME, f"{size} bytes exceeds the limit of {limits.max_message_bytes}"
            )
        if frame[0] not in _MAP_MARKERS:
            # Not a msgpack map, so not a structured message: upstream reads it as a
            # bare id (a one-character id such as "7" is also a msgpack integer).
            # It is never unpacked, so array headers in it allocate nothing.
            return _decode_bare(frame, role, limits)
        try:
            data = unpack_bounded(frame, limits._notify_options, limits._notify_small)
        except Exception as exc:  # msgpack raises ValueError subclasses and TypeError
            raise WireDecodeError(
                WHOLE_FRAME, f"invalid msgpack map ({type_name(exc)}: {exc})"
            ) from None
        return _decode_structured(data, role, limits)
    except WireDecodeError:
        raise
    except Exception as exc:  # defence in depth: a validator bug must not kill a listener
        raise WireDecodeError(WHOLE_FRAME, f"undecodable ({type_name(exc)}: {exc})") from exc


def _decode_bare(frame: bytes, role: Role | None, limits: WireLimits) -> NotifyMessage:
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        raise WireDecodeError(
            WHOLE_FRAME, "neither a msgpack map nor a UTF-8 transfer id"
        ) from None
    if role is None:
        raise WireDecodeError(
            WHOLE_FRAME, "a bare transfer id needs the receiver's role (producer or consumer)"
        )
    if role is Role.CONSUMER:
        return WriteDone(
            check_id(text, "transfer_id", limits, WireDecodeError), None, WireForm.BARE_ID
        )
    rank: int | None = None
    match = BARE_RANK.match(text)
    if match is not None:
        text, rank = match.group(1), int(match.group(2))
        check_int(rank, "transfer_id (tp rank suffix)", 0, limits.max_rank, WireDecodeError)
    transfer_id = check_id(text, "transfer_id", limits, WireDecodeError)
    return Release(transfer_id, None, rank, WireForm.BARE_ID)


def _optional_count(data: dict, name: str, limits: WireLimits) -> int | None:
    value = data.get(name)
    if value is None or (type(value) is int and 1 <= value <= limits.max_count):
        return value
    return check_int(value, name, 1, limits.max_count, WireDecodeError)  # raises with the reason


def _optional_rank(data: dict, name: str, limits: WireLimits) -> int | None:
    # Absent (or nil) means the sender did not say; -1 is never written for that.
    value = data.get(name)
    if value is None:
        return None
    return check_int(value, name, 0, limits.max_rank, WireDecodeError)


def _required_seq(data: dict, limits: WireLimits) -> int:
    if "seq" not in data:
        raise WireDecodeError("seq", "missing")
    return check_int(data["seq"], "seq", 0, limits.max_seq, WireDecodeError)


def _decode_write_done(
    data: dict, transfer_id: str, limits: WireLimits, form: WireForm
) -> NotifyMessage:
    writers = _optional_count(data, "num_writers", limits)
    rank = data.get("producer_rank")
    if rank is None:  # upstream's form: the hot path, one lookup
        return WriteDone(transfer_id, writers, form)
    return WriteDone(
        transfer_id, writers, form, producer_rank=_optional_rank(data, "producer_rank", limits)
    )


def _decode_write_failed(
    data: dict, transfer_id: str, limits: WireLimits, form: WireForm
) -> NotifyMessage:
    reason = data.get("reason")
    if reason is not None:
        reason = check_reason(reason, "reason", limits, WireDecodeError)
    stopped = data.get("writes_stopped")
    if stopped is not None:
        stopped = check_bool(stopped, "writes_stopped", WireDecodeError)
    return WriteFailed(
        transfer_id,
        form,
        reason=reason,
        writes_stopped=stopped,
        producer_rank=_optional_rank(data, "producer_rank", limits),
    )


def _decode_release(
    data: dict, transfer_id: str, limits: WireLimits, form: WireForm
) -> NotifyMessage:
    return Release(
        transfer_id,
        _optional_count(data, "consumer_tp_size", limits),
        None,
        form,
        consumer_rank=_optional_rank(data, "consumer_rank", limits),
    )


def _decode_heartbeat(
    data: dict, transfer_id: str, limits: WireLimits, form: WireForm
) -> NotifyMessage:
    port = data.get("reply_port")
    if port is not None:
        port = check_int(port, "reply_port", 1, 65535, WireDecodeError)
    return Heartbeat(
        transfer_id,
        _required_seq(data, limits),
        _optional_rank(data, "consumer_rank", limits),
        reply_port=port,
    )


def _decode_lease_granted(
    data: dict, transfer_id: str, limits: WireLimits, form: WireForm
) -> NotifyMessage:
    seq = _required_seq(data, limits)
    if "lease_s" not in data:
        raise WireDecodeError("lease_s", "missing")
    lease = check_seconds(data["lease_s"], "lease_s", limits.max_lease_s, WireDecodeError)
    return LeaseGranted(transfer_id, seq, lease, _optional_rank(data, "consumer_rank", limits))


def _decode_remote_blocks(
    data: dict, transfer_id: str, limits: WireLimits, form: WireForm
) -> NotifyMessage:
    if "req_id" not in data:
        raise WireDecodeError("req_id", "missing")
    req_id = check_id(data["req_id"], "req_id", limits, WireDecodeError)
    if "block_notify_list" not in data:
        raise WireDecodeError("block_notify_list", "missing")
    blocks = check_blocks(data["block_notify_list"], "block_notify_list", limits, WireDecodeError)
    # Upstream readers default a missing decode_rank to 0; keep that leniency.
    rank = data.get("decode_rank", 0)
    check_int(rank, "decode_rank", 0, limits.max_rank, WireDecodeError)
    digest = data.get("prompt_digest")
    if digest is not None:
        digest = check_digest(digest, "prompt_digest", WireDecodeError)
    dp_rank = data.get("decode_dp_rank")
    if dp_rank is not None:
        check_int(dp_rank, "decode_dp_rank", 0, limits.max_rank, WireDecodeError)
    return RemoteBlocks(
        transfer_id, req_id, blocks, rank, form, prompt_digest=digest, decode_dp_rank=dp_rank
    )


_DECODERS = {
    "remote_blocks": _decode_remote_blocks,
    "release": _decode_release,
    "write_done": _decode_write_done,
    "write_failed": _decode_write_failed,
    "heartbeat": _decode_heartbeat,
    "lease_granted": _decode_lease_granted,
}


def _decode_structured(data: dict, role: Role | None, limits: WireLimits) -> NotifyMessage:
    kind = data.get("type")
    form = WireForm.TYPED
    if kind is None:
        if "req_id" not in data:
            raise WireDecodeError("type", "missing (and no req_id to mark an older remote_blocks)")
        kind, form = "remote_blocks", WireForm.UNTYPED
    elif type(kind) is not str:
        raise WireDecodeError("type", f"expected a string, got {type_name(kind)}")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        expected = ", ".join(sorted(_DECODERS))
        raise WireDecodeError(
            "type", f"unknown message type {kind[:64]!r}; expected one of {expected}"
        )
    if role is not None and RECEIVER[kind] is not role:
        raise WireDecodeError(
            "type",
            f"{kind!r} is meant for the {RECEIVER[kind].value}, but this listener is the {role.value}",
        )
    transfer_id = data.get("transfer_id")
    if transfer_id is None:
        raise WireDecodeError("transfer_id", "missing")
    check_id(transfer_id, "transfer_id", limits, WireDecodeError)
    return decoder(data, transfer_id, limits, form)
