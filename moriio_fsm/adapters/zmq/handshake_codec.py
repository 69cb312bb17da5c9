"""The handshake port's wire form: the request frame, and the two-part reply both ways.

Rules: the request is the single frame ``b"get_meta_msg"``; the reply is two messages, each
``[b"", payload]``: the agent metadata map, then a map of layer name to packed memory
descriptors. Only ``WireDecodeError`` escapes the decoders; sizes are capped by ``WireLimits``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgpack

from .errors import WireDecodeError
from .wire_fields import WHOLE_FRAME, check_id, check_int, type_name
from .wire_limits import DEFAULT_LIMITS, WireLimits, unpack_bounded

__all__ = [
    "HANDSHAKE_REQUEST",
    "AgentMetadata",
    "HandshakeReply",
    "decode_handshake_reply",
    "decode_handshake_request",
    "encode_handshake_reply",
]

HANDSHAKE_REQUEST = b"get_meta_msg"


@dataclass(frozen=True, slots=True)
class AgentMetadata:
    """What a peer needs to reach this engine's KV cache over RDMA."""

    engine_id: str
    agent_metadata: bytes  # packed mori engine descriptor
    kv_caches_base_addr: tuple[int, ...]
    num_blocks: int
    block_len: int
    attn_backend_name: str
    #: Extension: what the KV cache holds (layout, dtype, block_size, num_kv_heads,
    #: head_size ...), so two peers whose caches differ are refused at the handshake.
    kv_format: Mapping[str, str | int] | None = None


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    """The two-part handshake answer: agent metadata and per-layer memory descriptors."""

    metadata: AgentMetadata
    layer_memory: Mapping[str, tuple[bytes, ...]]


_METADATA_FIELDS = (
    "engine_id",
    "agent_metadata",
    "kv_caches_base_addr",
    "num_blocks",
    "block_len",
    "attn_backend_name",
)
_MAX_U64 = (1 << 64) - 1


def decode_handshake_request(frame: bytes | bytearray | memoryview) -> None:
    """Accept the handshake request frame; raise ``WireDecodeError`` for anything else."""
    if bytes(frame[: len(HANDSHAKE_REQUEST) + 1]) != HANDSHAKE_REQUEST:
        shown = bytes(frame[:32])
        raise WireDecodeError(
            WHOLE_FRAME, f"expected the handshake request {HANDSHAKE_REQUEST!r}, got {shown!r}"
        )


def encode_handshake_reply(reply: HandshakeReply) -> tuple[bytes, bytes]:
    """Encode the two reply payloads (each is sent as ``[b"", payload]``)."""
    meta = reply.metadata
    metadata = msgpack.packb(
        {
            "engine_id": meta.engine_id,
            "agent_metadata": bytes(meta.agent_metadata),
            "kv_caches_base_addr": list(meta.kv_caches_base_addr),
            "num_blocks": meta.num_blocks,
            "block_len": meta.block_len,
            "attn_backend_name": meta.attn_backend_name,
            **({"kv_format": dict(meta.kv_format)} if meta.kv_format is not None else {}),
        }
    )
    layers = msgpack.packb(
        {name: [bytes(d) for d in descs] for name, descs in reply.layer_memory.items()}
    )
    return metadata, layers


def decode_handshake_reply(
    metadata_frame: bytes, layers_frame: bytes, *, limits: WireLimits = DEFAULT_LIMITS
) -> HandshakeReply:
    """Decode and validate both reply payloads; raises only ``WireDecodeError``."""
    try:
        return _decode_handshake_reply(metadata_frame, layers_frame, limits)
    except WireDecodeError:
        raise
    except Exception as exc:
        raise WireDecodeError(
            WHOLE_FRAME, f"undecodable handshake reply ({type_name(exc)}: {exc})"
        ) from exc


def _unpack_map(frame: Any, what: str, limits: WireLimits) -> dict:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireDecodeError(what, f"expected bytes, got {type_name(frame)}")
    if len(frame) > limits.max_handshake_bytes:
        raise WireDecodeError(
            what, f"{len(frame)} bytes exceeds the limit of {limits.max_handshake_bytes}"
        )
    try:
        data = unpack_bounded(bytes(frame), limits._handshake_options)
    except Exception as exc:
        raise WireDecodeError(what, f"invalid msgpack ({type_name(exc)}: {exc})") from None
    if not isinstance(data, dict):
        raise WireDecodeError(what, f"expected a map, got {type_name(data)}")
    return data


def _decode_handshake_reply(
    metadata_frame: Any, layers_frame: Any, limits: WireLimits
) -> HandshakeReply:
    data = _unpack_map(metadata_frame, "metadata", limits)
    engine_id, blob, addresses, num_blocks, block_len, backend = _decode_metadata_fields(
        data, limits
    )
    layers = _decode_layers(_unpack_map(layers_frame, "layers", limits), limits)
    kv_format = _decode_kv_format(data.get("kv_format"), limits)
    metadata = AgentMetadata(engine_id, blob, addresses, num_blocks, block_len, backend, kv_format)
    return HandshakeReply(metadata, MappingProxyType(layers))


def _decode_metadata_fields(data: dict, limits: WireLimits) -> tuple:
    """Upstream's metadata fields, in ``AgentMetadata``'s order, each checked."""
    for name in _METADATA_FIELDS:
        if name not in data:
            raise WireDecodeError(f"metadata.{name}", "missing")
    engine_id = check_id(data["engine_id"], "metadata.engine_id", limits, WireDecodeError)
    blob = data["agent_metadata"]
    if type(blob) is not bytes or not blob:
        raise WireDecodeError("metadata.agent_metadata", "expected non-empty binary data")
    addresses = data["kv_caches_base_addr"]
    if not isinstance(addresses, tuple):
        raise WireDecodeError(
            "metadata.kv_caches_base_addr", f"expected a list, got {type_name(addresses)}"
        )
    for index, address in enumerate(addresses):
        check_int(address, f"metadata.kv_caches_base_addr[{index}]", 0, _MAX_U64, WireDecodeError)
    num_blocks = check_int(data["num_blocks"], "metadata.num_blocks", 1, _MAX_U64, WireDecodeError)
    block_len = check_int(data["block_len"], "metadata.block_len", 1, _MAX_U64, WireDecodeError)
    backend = check_id(
        data["attn_backend_name"], "metadata.attn_backend_name", limits, WireDecodeError
    )
    return engine_id, blob, addresses, num_blocks, block_len, backend


def _decode_layers(layers_raw: dict, limits: WireLimits) -> dict[str, tuple[bytes, ...]]:
    layers: dict[str, tuple[bytes, ...]] = {}
    for layer, descriptors in layers_raw.items():
        name = check_id(layer, "layers.<name>", limits, WireDecodeError)
        where = f"layers[{name!r}]"
        if not isinstance(descriptors, tuple) or not descriptors:
            raise WireDecodeError(where, "expected a non-empty list of packed memory descriptors")
        if len(descriptors) > limits.max_descriptors_per_layer:
            raise WireDecodeError(
                where,
                f"{len(descriptors)} descriptors exceeds the limit of "
                f"{limits.max_descriptors_per_layer}",
            )
        for index, desc in enumerate(descriptors):
            if type(desc) is not bytes or not desc:
                raise WireDecodeError(f"{where}[{index}]", "expected non-empty binary data")
        layers[name] = descriptors
    return layers


def _decode_kv_format(kv_format: Any, limits: WireLimits) -> Mapping[str, str | int] | None:
    """The extension's ``kv_format`` map, read-only; None when the peer sent none."""
    if kv_format is None:
        return None
    if not isinstance(kv_format, dict) or len(kv_format) > 32:
        raise WireDecodeError(
            "metadata.kv_format", f"expected a small map, got {type_name(kv_format)}"
        )
    for key, value in kv_format.items():
        check_id(key, "metadata.kv_format.<key>", limits, WireDecodeError)
        if type(value) is int:
            check_int(value, f"metadata.kv_format[{key!r}]", 0, _MAX_U64, WireDecodeError)
        else:
            check_id(value, f"metadata.kv_format[{key!r}]", limits, WireDecodeError)
    return MappingProxyType(dict(kv_format))
