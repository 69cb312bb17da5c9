"""mori's ``IOEngineSession`` for the stand-in: posts between one local and one remote region, fixed when made.

Rules: the bindings are mori's (``pybind_io.cpp``); a session points at its engine without keeping it alive, as
the native one does with a raw pointer, and a session used after its engine was freed is recorded as an incident
and fails its status (native mori would use freed memory); ``Alive`` is false once a failure of the peer or the
device was seen (1.2.4 asks the queue pairs).
"""

from __future__ import annotations

import weakref

from .binding import (
    SIZE_T,
    UINT64,
    Param,
    instance_of,
    no_constructor,
    signature,
    vector_of,
)
from .incidents import record as record_incident
from .mover import Region, RemoteRegion
from .rdma import Route, post_batch
from .transfer_status import TransferStatus

__all__ = ["IOEngineSession"]

_ERR_BAD_STATE = 14
_STATUS = instance_of(TransferStatus, pointer=True)
_OFFSETS = vector_of(SIZE_T)
# Read and Write take (local offset, remote offset, size, status, transfer uid); BatchRead and
# BatchWrite take a vector of each offset and size, with one status and uid for the batch.
_ONE_TRANSFER = (Param(SIZE_T), Param(SIZE_T), Param(SIZE_T), Param(_STATUS), Param(UINT64))
_BATCH_TRANSFER = (Param(_OFFSETS), Param(_OFFSETS), Param(_OFFSETS), Param(_STATUS), Param(UINT64))


class IOEngineSession:
    """Made by ``IOEngine.CreateSession`` only."""

    __slots__ = ("_engine", "_route_local", "_route_remote", "__weakref__")
    __init__ = no_constructor("IOEngineSession")
    _engine: weakref.ref
    _route_local: Region
    _route_remote: RemoteRegion

    @classmethod
    def made(cls, route: Route) -> IOEngineSession:
        session = object.__new__(cls)
        session._engine = weakref.ref(route.engine)
        session._route_local, session._route_remote = route.local, route.remote
        return session

    def _route(self, what: str, status) -> Route | None:
        engine = self._engine()
        if engine is None:
            record_incident(
                f"use after free: IOEngineSession.{what} called after its IOEngine was freed"
            )
            if status is not None:
                status.update(_ERR_BAD_STATE, "stand-in: the session's engine is gone")
            return None
        return Route(engine, self._route_local, self._route_remote)

    @signature("IOEngineSession", returns="int")
    def AllocateTransferUniqueId(self) -> int:
        route = self._route("AllocateTransferUniqueId", None)
        return 0 if route is None else route.engine.standin_next_uid()

    @signature("IOEngineSession", *_ONE_TRANSFER)
    def Read(self, local_offset, remote_offset, size, status, uid) -> None:
        self._post("Read", "read", [local_offset], [remote_offset], [size], status, uid)

    @signature("IOEngineSession", *_ONE_TRANSFER)
    def Write(self, local_offset, remote_offset, size, status, uid) -> None:
        self._post("Write", "write", [local_offset], [remote_offset], [size], status, uid)

    @signature("IOEngineSession", *_BATCH_TRANSFER)
    def BatchRead(self, local_offsets, remote_offsets, sizes, status, uid) -> None:
        self._post("BatchRead", "read", local_offsets, remote_offsets, sizes, status, uid)

    @signature("IOEngineSession", *_BATCH_TRANSFER)
    def BatchWrite(self, local_offsets, remote_offsets, sizes, status, uid) -> None:
        self._post("BatchWrite", "write", local_offsets, remote_offsets, sizes, status, uid)

    @signature("IOEngineSession", returns="bool")
    def Alive(self) -> bool:
        route = self._route("Alive", None)
        return route is not None and route.engine.standin_peer_alive(self._route_remote.engine_key)

    def _post(self, what: str, op: str, local_offsets, remote_offsets, sizes, status, uid) -> None:
        if status is None:
            raise RuntimeError(
                f"stand-in: IOEngineSession.{what} got no TransferStatus (None); native mori "
                "would dereference a null pointer"
            )
        route = self._route(what, status)
        if route is not None:
            post_batch(route, op, local_offsets, remote_offsets, sizes, status, uid)
