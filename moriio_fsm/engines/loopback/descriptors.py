"""The loopback engine's descriptors: who an engine is, and where a registered region lives and can be mapped.

Rules: they travel as msgpack maps tagged with their kind; unpacking takes only bytes of its own kind with every
field present (``TypeError`` for non-bytes, ``ValueError`` naming what is wrong).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ..checks import require_bytes

__all__ = ["NOT_SHARED", "LoopbackEngineDesc", "LoopbackMemoryDesc"]

_ENGINE_DESC_KIND = "moriio-loopback-engine"
_MEMORY_DESC_KIND = "moriio-loopback-memory"
#: ``region_fd`` of memory that is not shared: only engines in its process can reach it.
NOT_SHARED = -1


def _unpack_fields(what: str, kind: str, packed: Any, names: tuple[str, ...]) -> dict:
    data = require_bytes(what, packed)
    try:
        fields = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"{what} is not a packed descriptor: {exc}") from None
    if not isinstance(fields, dict) or fields.get("kind") != kind:
        raise ValueError(f"{what} is not a packed {kind} descriptor")
    missing = [name for name in names if name not in fields]
    if missing:
        raise ValueError(f"{what} lacks field(s) {', '.join(missing)}")
    return fields


@dataclass(frozen=True, slots=True)
class LoopbackEngineDesc:
    """Who a loopback engine is and which process it lives in."""

    key: str
    pid: int
    hostname: str
    host: str = ""
    port: int = 0

    _FIELDS = ("key", "pid", "hostname", "host", "port")

    def pack(self) -> bytes:
        return msgpack.packb(
            {
                "kind": _ENGINE_DESC_KIND,
                "key": self.key,
                "pid": self.pid,
                "hostname": self.hostname,
                "host": self.host,
                "port": self.port,
            }
        )

    @classmethod
    def unpack(cls, packed: bytes) -> LoopbackEngineDesc:
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for malformed bytes."""
        fields = _unpack_fields("engine descriptor", _ENGINE_DESC_KIND, packed, cls._FIELDS)
        return cls(**{name: fields[name] for name in cls._FIELDS})


@dataclass(frozen=True, slots=True)
class LoopbackMemoryDesc:
    """One registered region: whose it is, how big, and where a peer can map it.

    ``region_fd`` is -1 for memory that is not shared: only engines in the same
    process can reach it.
    """

    engine_key: str
    mem_id: int
    size: int
    pid: int
    region_fd: int
    region_token: str
    region_offset: int
    dtype: str
    shape: tuple[int, ...]

    _FIELDS = (
        "engine_key",
        "mem_id",
        "size",
        "pid",
        "region_fd",
        "region_token",
        "region_offset",
        "dtype",
        "shape",
    )

    @property
    def shared(self) -> bool:
        return self.region_fd != NOT_SHARED

    def pack(self) -> bytes:
        body = {name: getattr(self, name) for name in self._FIELDS}
        body["shape"] = list(self.shape)
        body["kind"] = _MEMORY_DESC_KIND
        return msgpack.packb(body)

    @classmethod
    def unpack(cls, packed: bytes) -> LoopbackMemoryDesc:
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for malformed bytes."""
        fields = _unpack_fields("memory descriptor", _MEMORY_DESC_KIND, packed, cls._FIELDS)
        values = {name: fields[name] for name in cls._FIELDS}
        values["shape"] = tuple(values["shape"])
        return cls(**values)
