"""A request's ``kv_transfer_params``, checked: what the proxy asked this instance to do.

The keys are upstream MoRIIO's (``transfer_id``, ``remote_host``, ``remote_notify_port``,
``remote_handshake_port``, ``remote_block_ids``, ``remote_engine_id``, ``remote_dp_rank``,
``remote_tp_size``, ...). They come from the client, so every value is checked here and a
bad one raises ``TransferParamsError`` naming the key; the host is checked again against
the trusted-peer policy before anything dials it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import MoriioFsmError

#: How long a transfer id may be, and what it may hold (ids travel in logs and traces).
_TRANSFER_ID = re.compile(r"^[A-Za-z0-9._:@+=-]{1,200}$")
_DIGEST = re.compile(r"^[0-9a-f]{1,64}$")
MAX_BLOCKS = 1 << 20


class TransferParamsError(MoriioFsmError, ValueError):
    """A request's ``kv_transfer_params`` cannot drive a transfer; the message names the key."""


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where the other instance's rank 0 listens (ports are bases: ranks add offsets)."""

    host: str
    notify_port: int
    handshake_port: int
    dp_rank: int = 0
    tp_size: int = 1
    engine_id: str = ""


@dataclass(frozen=True, slots=True)
class TransferParams:
    """What a request asks for: to send its KV (``do_remote_decode``) or to receive it."""

    transfer_id: str
    do_remote_decode: bool
    do_remote_prefill: bool
    peer: PeerAddress | None
    remote_block_ids: tuple[int, ...] = ()
    #: READ mode: P's fingerprint of the prompt whose KV ``remote_block_ids`` hold ("": none).
    prompt_digest: str = ""
    #: READ mode: how many leading tokens of D's prompt that KV covers (0: all of it). D's prompt may
    #: run longer: P's first output token appended, which D then computes itself.
    prompt_tokens: int = 0


_MAX_TOKENS = (1 << 31) - 1


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TransferParamsError(
            f"kv_transfer_params[{key!r}]: expected true or false, got "
            f"{type(value).__name__} {value!r}"
        )
    return value


def _int(params: Mapping[str, Any], key: str, default: int | None, low: int, high: int) -> int:
    value = params.get(key, default)
    if value is None:
        raise TransferParamsError(f"kv_transfer_params[{key!r}]: missing; expected an integer")
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if type(value) is not int or not low <= value <= high:
        raise TransferParamsError(
            f"kv_transfer_params[{key!r}]: expected an integer in [{low}, {high}], got {value!r}"
        )
    return value


def _block_ids(params: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = params.get(key)
    # One list, or one list per KV cache group: a single-group model uses the first.
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        if len(value) != 1:
            raise TransferParamsError(
                f"kv_transfer_params[{key!r}]: {len(value)} KV cache "
                "groups; this connector moves single-group models"
            )
        value = value[0]
    if (
        not isinstance(value, (list, tuple))
        or len(value) > MAX_BLOCKS
        or not all(type(b) is int and 0 <= b < (1 << 31) for b in value)
    ):
        raise TransferParamsError(
            f"kv_transfer_params[{key!r}]: expected a list of block ids "
            f"(non-negative integers), got {_short(value)}"
        )
    return tuple(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_transfer_params(params: Mapping[str, Any] | None) -> TransferParams | None:
    """The checked params of a request, or None when it asks for no transfer at all."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise TransferParamsError(
            f"kv_transfer_params: expected a mapping, got {type(params).__name__}"
        )
    decode = _flag(params, "do_remote_decode")
    prefill = _flag(params, "do_remote_prefill")
    if not decode and not prefill:
        return None
    if decode and prefill:
        raise TransferParamsError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill "
            "are both true; a request either sends or receives its KV"
        )
    transfer_id = params.get("transfer_id")
    if not isinstance(transfer_id, str) or not _TRANSFER_ID.match(transfer_id):
        raise TransferParamsError(
            "kv_transfer_params['transfer_id']: expected 1-200 characters of letters, digits "
            f"and ._:@+=-, got {_short(transfer_id)}"
        )
    peer = None
    if params.get("remote_host") is not None:
        host = params["remote_host"]
        if not isinstance(host, str) or not host or len(host) > 253:
            raise TransferParamsError(
                f"kv_transfer_params['remote_host']: expected a host "
                f"name or address, got {_short(host)}"
            )
        tp_size = params.get("remote_tp_size") or params.get("tp_size") or 1
        engine_id = params.get("remote_engine_id") or ""
        if not isinstance(engine_id, str):
            raise TransferParamsError(
                f"kv_transfer_params['remote_engine_id']: expected a "
                f"string, got {_short(engine_id)}"
            )
        peer = PeerAddress(
            host=host,
            notify_port=_int(params, "remote_notify_port", None, 1, 65535),
            handshake_port=_int(params, "remote_handshake_port", None, 1, 65535),
            dp_rank=_int(params, "remote_dp_rank", 0, 0, 4096),
            tp_size=_int({"remote_tp_size": tp_size}, "remote_tp_size", 1, 1, 4096),
            engine_id=engine_id,
        )
    remote_blocks: tuple[int, ...] = ()
    if prefill and params.get("remote_block_ids") is not None:
        remote_blocks = _block_ids(params, "remote_block_ids")
    digest = params.get("prompt_digest") or ""
    if not isinstance(digest, str) or (digest and not _DIGEST.match(digest)):
        raise TransferParamsError(
            f"kv_transfer_params['prompt_digest']: expected up to 64 "
            f"lower-case hex digits, got {_short(digest)}"
        )
    covered = _int(params, "remote_prompt_tokens", 0, 0, _MAX_TOKENS) if prefill else 0
    return TransferParams(transfer_id, decode, prefill, peer, remote_blocks, digest, covered)
