"""Typed messages into notify-port frames: upstream's exact bytes when no extension field is set.

Rules: every field is checked before anything is packed, and a bad one raises ``WireEncodeError``
naming it; keys go in upstream's order, extension keys last and only when set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from .errors import WireEncodeError
from .messages import (
    BARE_RANK,
    Heartbeat,
    LeaseGranted,
    NotifyMessage,
    Release,
    RemoteBlocks,
    WireForm,
    WriteDone,
    WriteFailed,
)
from .wire_fields import (
    check_blocks,
    check_bool,
    check_digest,
    check_id,
    check_int,
    check_reason,
    check_seconds,
    type_name,
)
from .wire_limits import DEFAULT_LIMITS, WireLimits

__all__ = ["encode_notify"]

_packb = msgpack.packb  # upstream's msgpack.dumps with default options (use_bin_type=True)


def encode_notify(message: NotifyMessage, *, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``message`` in upstream's wire format, in the form it names.

    Raises ``WireEncodeError`` if a field holds a value the receiver would reject.
    """
    transfer_id = check_id(message.transfer_id, "transfer_id", limits, WireEncodeError)
    encoder = _ENCODERS.get(type(message))
    if encoder is None:
        raise WireEncodeError("<message>", f"not a notify message: {type_name(message)}")
    return encoder(message, transfer_id, limits)


def _encode_write_done(message: WriteDone, transfer_id: str, limits: WireLimits) -> bytes:
    rank = message.producer_rank
    if message.form is WireForm.BARE_ID:
        if rank is not None:
            raise WireEncodeError(
                "producer_rank", "the bare-id form cannot carry it; send the typed form"
            )
        return transfer_id.encode("utf-8")
    writers = message.num_writers
    if (
        rank is None
    ):  # upstream's form: the hot path, packed without building a payload step by step
        if writers is None:
            return _packb({"type": "write_done", "transfer_id": transfer_id})
        if type(writers) is not int or not 1 <= writers <= limits.max_count:
            check_int(writers, "num_writers", 1, limits.max_count, WireEncodeError)
        return _packb({"type": "write_done", "transfer_id": transfer_id, "num_writers": writers})
    payload: dict[str, Any] = {"type": "write_done", "transfer_id": transfer_id}
    if writers is not None:
        payload["num_writers"] = check_int(
            writers, "num_writers", 1, limits.max_count, WireEncodeError
        )
    payload["producer_rank"] = _encode_rank(rank, "producer_rank", limits)
    return _packb(payload)


def _encode_write_failed(message: WriteFailed, transfer_id: str, limits: WireLimits) -> bytes:
    payload: dict[str, Any] = {"type": "write_failed", "transfer_id": transfer_id}
    if message.reason is not None:
        payload["reason"] = check_reason(message.reason, "reason", limits, WireEncodeError)
    if message.writes_stopped is not None:
        payload["writes_stopped"] = check_bool(
            message.writes_stopped, "writes_stopped", WireEncodeError
        )
    if message.producer_rank is not None:
        payload["producer_rank"] = _encode_rank(message.producer_rank, "producer_rank", limits)
    return _packb(payload)


def _encode_release(message: Release, transfer_id: str, limits: WireLimits) -> bytes:
    if message.form is WireForm.BARE_ID:
        return _encode_bare_release(message, transfer_id, limits)
    payload: dict[str, Any] = {"type": "release", "transfer_id": transfer_id}
    if message.consumer_tp_size is not None:
        payload["consumer_tp_size"] = check_int(
            message.consumer_tp_size, "consumer_tp_size", 1, limits.max_count, WireEncodeError
        )
    if message.consumer_rank is not None:
        payload["consumer_rank"] = _encode_rank(message.consumer_rank, "consumer_rank", limits)
    return _packb(payload)


def _encode_bare_release(message: Release, transfer_id: str, limits: WireLimits) -> bytes:
    """``<transfer_id>`` or ``<transfer_id>:tp<rank>``, refusing an id the reader would misread."""
    if message.consumer_rank is not None:
        raise WireEncodeError(
            "consumer_rank",
            "the bare-id form cannot carry it; set sender_tp_rank or send the typed form",
        )
    if message.sender_tp_rank is None:
        if BARE_RANK.match(transfer_id) is not None:
            raise WireEncodeError(
                "transfer_id",
                f"{transfer_id[:64]!r} ends in ':tp<rank>', which the bare form reads as a "
                "sender rank; send it typed or set sender_tp_rank",
            )
        return transfer_id.encode("utf-8")
    rank = check_int(message.sender_tp_rank, "sender_tp_rank", 0, limits.max_rank, WireEncodeError)
    return f"{transfer_id}:tp{rank}".encode()


def _lease_payload(
    message: Heartbeat | LeaseGranted, transfer_id: str, limits: WireLimits
) -> dict[str, Any]:
    """The fields a heartbeat and its grant share, in wire order; both exist in the typed form only."""
    if message.form is not WireForm.TYPED:
        raise WireEncodeError("form", f"{message.kind} has only the typed form, got {message.form}")
    payload: dict[str, Any] = {"type": message.kind, "transfer_id": transfer_id}
    if message.consumer_rank is not None:
        payload["consumer_rank"] = _encode_rank(message.consumer_rank, "consumer_rank", limits)
    payload["seq"] = check_int(message.seq, "seq", 0, limits.max_seq, WireEncodeError)
    return payload


def _encode_heartbeat(message: Heartbeat, transfer_id: str, limits: WireLimits) -> bytes:
    payload = _lease_payload(message, transfer_id, limits)
    if message.reply_port is not None:
        payload["reply_port"] = check_int(
            message.reply_port, "reply_port", 1, 65535, WireEncodeError
        )
    return _packb(payload)


def _encode_lease_granted(message: LeaseGranted, transfer_id: str, limits: WireLimits) -> bytes:
    payload = _lease_payload(message, transfer_id, limits)
    payload["lease_s"] = check_seconds(
        message.lease_s, "lease_s", limits.max_lease_s, WireEncodeError
    )
    return _packb(payload)


def _encode_remote_blocks(message: RemoteBlocks, transfer_id: str, limits: WireLimits) -> bytes:
    payload: dict[str, Any] = {
        "req_id": check_id(message.req_id, "req_id", limits, WireEncodeError),
        "transfer_id": transfer_id,
        "block_notify_list": check_blocks(
            message.block_ids, "block_notify_list", limits, WireEncodeError
        ),
        "decode_rank": check_int(
            message.decode_rank, "decode_rank", 0, limits.max_rank, WireEncodeError
        ),
    }
    if message.prompt_digest is not None:
        payload["prompt_digest"] = check_digest(
            message.prompt_digest, "prompt_digest", WireEncodeError
        )
    if message.decode_dp_rank is not None:
        payload["decode_dp_rank"] = check_int(
            message.decode_dp_rank, "decode_dp_rank", 0, limits.max_rank, WireEncodeError
        )
    if message.form is not WireForm.UNTYPED:
        payload["type"] = "remote_blocks"
    return _packb(payload)


def _encode_rank(value: object, name: str, limits: WireLimits) -> int:
    # None, not -1, says "unknown": the wire has one spelling for it (the field left out).
    if value == -1 and type(value) is int:
        raise WireEncodeError(
            name, "-1 is not a rank; leave the field as None when the rank is unknown"
        )
    return check_int(value, name, 0, limits.max_rank, WireEncodeError)


_ENCODERS: dict[type, Callable[..., bytes]] = {
    WriteDone: _encode_write_done,
    WriteFailed: _encode_write_failed,
    Release: _encode_release,
    Heartbeat: _encode_heartbeat,
    LeaseGranted: _encode_lease_granted,
    RemoteBlocks: _encode_remote_blocks,
}
