"""mori's plain bound classes: ``IOEngineConfig``, the backend configs, ``EngineDesc``, ``MemoryDesc`` and
``PeerFailureEvent``, with their C++ field types and mori's msgpack wire format.

Rules: read-write fields convert what is assigned as pybind11 does (``TypeError`` otherwise), read-only fields
refuse assignment; ``pack`` gives mori's msgpack array; ``unpack`` takes ``bytes`` only and fails with
``RuntimeError`` (a C++ exception) on anything that is not such an array; descriptors compare with ``==`` and,
as pybind11 makes a class that defines ``==`` without a hash, are unhashable.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .binding import (
    BOOL,
    BYTES,
    INT,
    SIZE_T,
    STR,
    UINT16,
    UINT32,
    UINT64,
    Cpp,
    NoMatch,
    Param,
    enum_of,
    no_constructor,
    signature,
)
from .codes import MemoryLocationType, PeerFailureReason, PollCqMode

__all__ = [
    "BackendConfig",
    "EngineDesc",
    "FabricBackendConfig",
    "IOEngineConfig",
    "MemoryDesc",
    "PeerFailureEvent",
    "RdmaBackendConfig",
    "XgmiBackendConfig",
]

_IPC_HANDLE_SIZE = 64


def _read_write(name: str, cpp: Cpp) -> property:
    def get(self):
        return getattr(self, "_" + name)

    def set_(self, value):
        try:
            setattr(self, "_" + name, cpp.load(value))
        except NoMatch:
            raise TypeError(
                f"(): incompatible function arguments. The following argument types are supported:\n"
                f"    1. (self: mori.cpp.{type(self).__name__}, arg0: {cpp.shown}) -> None\n\n"
                f"Invoked with: {value!r}"
            ) from None

    return property(get, set_)


def _read_only(name: str, shown: Any = None) -> property:
    return property(
        lambda self: shown(getattr(self, "_" + name)) if shown else getattr(self, "_" + name)
    )


def _expose(kind: type, fields: list[tuple[str, property]]) -> None:
    """Give ``kind`` its bound fields (a class body cannot make them from a table)."""
    for name, field in fields:
        setattr(kind, name, field)


class IOEngineConfig:
    """``IOEngineConfig(host: str = "", port: uint16 = 0)``: where the engine's control plane listens."""

    __slots__ = ("_host", "_port")
    host = _read_write("host", STR)
    port = _read_write("port", UINT16)

    @signature("IOEngineConfig", Param(STR, "host", ""), Param(UINT16, "port", 0))
    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port


class BackendConfig:
    """The base of the backend configs; Python cannot make one."""

    __slots__ = ()
    __init__ = no_constructor("BackendConfig")


_RDMA_FIELDS = (
    ("qp_per_transfer", INT, 1),
    ("post_batch_size", INT, -1),
    ("num_worker_threads", INT, -1),
    ("poll_cq_mode", enum_of(PollCqMode), PollCqMode.POLLING),
    ("enable_notification", BOOL, True),
    ("notif_per_qp", UINT32, 1024),
    ("enable_transfer_chunking", BOOL, False),
    ("chunk_bytes", SIZE_T, 65536),
    ("max_chunks_per_transfer", INT, 64),
    ("num_nics_per_transfer", INT, 1),
)
_RDMA_EXTRA = (("max_send_wr", INT, 0), ("max_cqe_num", INT, 0), ("max_msg_sge", INT, 0))


class RdmaBackendConfig(BackendConfig):
    """``RdmaBackendConfig(qp_per_transfer=1, post_batch_size=-1, num_worker_threads=-1, poll_cq_mode=POLLING,
    enable_notification=True, notif_per_qp=1024, enable_transfer_chunking=False, chunk_bytes=65536,
    max_chunks_per_transfer=64, num_nics_per_transfer=1)``; ``max_send_wr``, ``max_cqe_num`` and
    ``max_msg_sge`` only as fields."""

    __slots__ = tuple("_" + name for name, _, _ in _RDMA_FIELDS + _RDMA_EXTRA)

    @signature(
        "RdmaBackendConfig", *(Param(cpp, name, default) for name, cpp, default in _RDMA_FIELDS)
    )
    def __init__(self, *values) -> None:
        for (name, _, _), value in zip(_RDMA_FIELDS, values):
            setattr(self, "_" + name, value)
        for name, _, default in _RDMA_EXTRA:
            setattr(self, "_" + name, default)


_expose(
    RdmaBackendConfig,
    [(name, _read_write(name, cpp)) for name, cpp, _ in _RDMA_FIELDS + _RDMA_EXTRA],
)


class XgmiBackendConfig(BackendConfig):
    """``XgmiBackendConfig(num_streams: int = 64, num_events: int = 64)``."""

    __slots__ = ("_num_streams", "_num_events")
    num_streams = _read_write("num_streams", INT)
    num_events = _read_write("num_events", INT)

    @signature("XgmiBackendConfig", Param(INT, "num_streams", 64), Param(INT, "num_events", 64))
    def __init__(self, num_streams: int, num_events: int) -> None:
        self._num_streams, self._num_events = num_streams, num_events


class FabricBackendConfig(BackendConfig):
    """``FabricBackendConfig(num_streams: int = 64, num_events: int = 64)``."""

    __slots__ = ("_num_streams", "_num_events")
    num_streams = _read_write("num_streams", INT)
    num_events = _read_write("num_events", INT)

    @signature("FabricBackendConfig", Param(INT, "num_streams", 64), Param(INT, "num_events", 64))
    def __init__(self, num_streams: int, num_events: int) -> None:
        self._num_streams, self._num_events = num_streams, num_events


def _unpack_fields(kind: str, packed: bytes, fields: tuple) -> list:
    """The values of mori's msgpack array ``packed``: as msgpack-c reads one, missing trailing fields keep
    their defaults and extra elements are ignored; any element of the wrong type is a C++ exception."""
    try:
        array = msgpack.unpackb(packed, raw=False, strict_map_key=True)
    except Exception as exc:
        raise RuntimeError(f"msgpack: {kind}: {exc}") from None
    if not isinstance(array, list):
        raise RuntimeError(
            f"std::bad_cast: a packed {kind} is a msgpack array, got {type(array).__name__}"
        )
    values = []
    for index, (name, cpp, default) in enumerate(fields):
        if index >= len(array):
            values.append(default)
            continue
        try:
            values.append(cpp.load(array[index]))
        except NoMatch:
            raise RuntimeError(
                f"std::bad_cast: {kind} field {name} cannot be {array[index]!r}"
            ) from None
    return values


def _strict(cpp: Cpp, kind: type) -> Cpp:
    """A wire field: only values of exactly ``kind`` (msgpack-c does not turn a string into a number)."""

    def load(value):
        if type(value) is not kind:
            raise NoMatch
        return cpp.load(value)

    return Cpp(cpp.shown, load)


def _load_handle(value: Any) -> bytes:
    # std::array<char, 64> travels as msgpack bin of exactly 64 bytes.
    if type(value) is not bytes or len(value) != _IPC_HANDLE_SIZE:
        raise NoMatch
    return value


def _load_location(value: Any) -> int:
    if type(value) is not int:
        raise NoMatch
    return UINT32.load(value)


_WIRE_STR = _strict(STR, str)
_WIRE_BIN = Cpp("bytes", _load_handle)
_ENGINE_FIELDS = (
    ("key", _WIRE_STR, ""),
    ("node_id", _WIRE_STR, ""),
    ("hostname", _WIRE_STR, ""),
    ("host", _WIRE_STR, ""),
    ("port", _strict(INT, int), 0),
    ("pid", _strict(INT, int), 0),
)


class EngineDesc:
    """An engine's identity and control-plane address; travels as ``pack()`` bytes."""

    __slots__ = tuple("_" + name for name, _, _ in _ENGINE_FIELDS)
    _key: str
    _node_id: str
    _hostname: str
    _host: str
    _port: int
    _pid: int
    # Read-only fields (properties, set below).
    key: str
    node_id: str
    hostname: str
    host: str
    port: int
    pid: int
    __init__ = no_constructor("EngineDesc")
    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def made(
        cls, key: str, node_id: str, hostname: str, host: str, port: int, pid: int
    ) -> EngineDesc:
        desc = object.__new__(cls)
        desc._key, desc._node_id, desc._hostname, desc._host, desc._port, desc._pid = (
            key,
            node_id,
            hostname,
            host,
            port,
            pid,
        )
        return desc

    def _fields(self) -> list:
        return [getattr(self, "_" + name) for name, _, _ in _ENGINE_FIELDS]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineDesc):
            return NotImplemented
        return self._fields() == other._fields()

    @signature("EngineDesc", returns="bytes")
    def pack(self) -> bytes:
        return msgpack.packb(self._fields(), use_bin_type=True)

    @staticmethod
    @signature("EngineDesc", Param(BYTES), returns="mori.cpp.EngineDesc", method=False)
    def unpack(packed: bytes) -> EngineDesc:
        return EngineDesc.made(*_unpack_fields("EngineDesc", packed, _ENGINE_FIELDS))

    def __repr__(self) -> str:
        return f"<mori.cpp.EngineDesc object (stand-in) key={self._key!r} pid={self._pid}>"


_LOC = Cpp("MemoryLocationType", _load_location)
_MEMORY_FIELDS = (
    ("engine_key", _WIRE_STR, ""),
    ("id", _strict(UINT32, int), 0),
    ("device_id", _strict(INT, int), -1),
    ("device_bus_id", _WIRE_STR, ""),
    ("data", _strict(UINT64, int), 0),
    ("size", _strict(SIZE_T, int), 0),
    ("loc", _LOC, 0),
    ("ipc_handle", _WIRE_BIN, bytes(_IPC_HANDLE_SIZE)),
    ("numa_node", _strict(INT, int), -1),
    ("ipc_offset", _strict(UINT64, int), 0),
    ("fabric_handle", _WIRE_BIN, bytes(_IPC_HANDLE_SIZE)),
    ("vpod_id", _strict(INT, int), -1),
    ("vpod_ppod_id", _WIRE_STR, ""),
    ("fabric_offset", _strict(UINT64, int), 0),
    ("fabric_alloc_size", _strict(UINT64, int), 0),
)
# What mori's operator== compares.
_MEMORY_COMPARED = (
    "engine_key",
    "id",
    "device_id",
    "device_bus_id",
    "data",
    "size",
    "loc",
    "numa_node",
    "ipc_offset",
)
_MEMORY_VISIBLE = (
    "engine_key",
    "id",
    "device_id",
    "device_bus_id",
    "numa_node",
    "data",
    "size",
    "ipc_handle",
)


_expose(EngineDesc, [(name, _read_only(name)) for name, _, _ in _ENGINE_FIELDS])


class MemoryDesc:
    """One registered memory region; travels as ``pack()`` bytes."""

    __slots__ = tuple("_" + name for name, _, _ in _MEMORY_FIELDS)
    _engine_key: str
    _id: int
    _size: int
    # Read-only fields (properties, set below).
    engine_key: str
    id: int
    device_id: int
    device_bus_id: str
    numa_node: int
    data: int
    size: int
    ipc_handle: bytes
    loc: Any
    __hash__ = None  # type: ignore[assignment]

    @signature("MemoryDesc")
    def __init__(self) -> None:
        for name, _, default in _MEMORY_FIELDS:
            setattr(self, "_" + name, default)

    @classmethod
    def made(cls, **values: Any) -> MemoryDesc:
        desc = cls()
        for name, value in values.items():
            setattr(desc, "_" + name, value)
        return desc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryDesc):
            return NotImplemented
        return all(
            getattr(self, "_" + name) == getattr(other, "_" + name) for name in _MEMORY_COMPARED
        )

    @signature("MemoryDesc", returns="bytes")
    def pack(self) -> bytes:
        values = [getattr(self, "_" + name) for name, _, _ in _MEMORY_FIELDS]
        return msgpack.packb(values, use_bin_type=True)

    @staticmethod
    @signature("MemoryDesc", Param(BYTES), returns="mori.cpp.MemoryDesc", method=False)
    def unpack(packed: bytes) -> MemoryDesc:
        values = _unpack_fields("MemoryDesc", packed, _MEMORY_FIELDS)
        return MemoryDesc.made(
            **{name: value for (name, _, _), value in zip(_MEMORY_FIELDS, values)}
        )

    def __repr__(self) -> str:
        return (
            f"<mori.cpp.MemoryDesc object (stand-in) engine_key={self._engine_key!r} id={self._id} "
            f"size={self._size}>"
        )


_expose(
    MemoryDesc,
    [(name, _read_only(name)) for name in _MEMORY_VISIBLE]
    + [("loc", _read_only("loc", MemoryLocationType.fresh))],
)

_FAILURE_FIELDS = ("remote_engine_key", "reason", "qp_num", "port_num", "device_name", "detail")


class PeerFailureEvent:
    """A peer, or the resource that reaches it, failed (1.2.4): what ``PopPeerFailure`` hands out."""

    __slots__ = tuple("_" + name for name in _FAILURE_FIELDS)
    __init__ = no_constructor("PeerFailureEvent")
    _remote_engine_key: str
    _reason: int
    _qp_num: int
    _port_num: int
    _device_name: str
    _detail: str

    @classmethod
    def made(
        cls,
        remote_engine_key: str,
        reason: Any,
        qp_num: int = 0,
        port_num: int = 0,
        device_name: str = "standin0",
        detail: str = "",
    ) -> PeerFailureEvent:
        event = object.__new__(cls)
        event._remote_engine_key, event._reason, event._qp_num = (
            remote_engine_key,
            int(reason),
            qp_num,
        )
        event._port_num, event._device_name, event._detail = port_num, device_name, detail
        return event

    def __repr__(self) -> str:
        return f"<mori.cpp.PeerFailureEvent object (stand-in) {self._remote_engine_key!r} reason={self._reason}>"


_expose(
    PeerFailureEvent,
    [(name, _read_only(name)) for name in _FAILURE_FIELDS if name != "reason"]
    + [("reason", _read_only("reason", PeerFailureReason.fresh))],
)
