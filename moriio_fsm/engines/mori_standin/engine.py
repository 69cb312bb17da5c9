"""mori's ``IOEngine`` for the stand-in: backends, remote engines, host memory registration, sessions, peer
failures and the engine-level calls, bound as ``pybind_io.cpp`` binds them.

Rules (mori's ``engine.cpp``): a second backend of one type only warns; RDMA needs an RDMA device (the stand-in
host has one unless ``HOST.rdma_device`` is False), refuses port 1 and turns port 0 into a port of its own; XGMI
is made when asked, and serves only GPU memory on one node, which the stand-in has none of, so its sessions are
None; a session needs a backend that can serve the pair, else None. Methods named ``standin_*`` are the
stand-in's own, for its other modules and for tests, never mori's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from .binding import (
    CAPSULE,
    INT,
    SIZE_T,
    STR,
    UINT64,
    Param,
    enum_of,
    instance_of,
    signature,
    vector_of,
)
from .codes import BackendType, MemoryLocationType, PeerFailureReason, StatusCode
from .descriptors import (
    BackendConfig,
    EngineDesc,
    FabricBackendConfig,
    IOEngineConfig,
    MemoryDesc,
    PeerFailureEvent,
    RdmaBackendConfig,
    XgmiBackendConfig,
)
from .faults import Faults
from .mover import Region, RegionTable, RemoteRegion
from .nic import NicListener
from .rdma import Route, post_batch
from .registry import add as add_engine
from .session import IOEngineSession
from .transfer_status import TransferStatus

__all__ = ["HOST", "FAULTS", "IOEngine"]

_log = logging.getLogger("moriio_fsm.engines.mori_standin")

_RDMA, _XGMI = int(BackendType.RDMA), int(BackendType.XGMI)
_XGMI_ONLY_PORT = 1  # mori's kXgmiOnlyFallbackPlaceholderPort
_MAX_PENDING_FAILURES = 1024  # mori's PeerFailureTracker::kMaxPending
_ERR_BAD_STATE = 14
_CONFIG_OF = {
    _RDMA: RdmaBackendConfig,
    _XGMI: XgmiBackendConfig,
    int(BackendType.FABRIC): FabricBackendConfig,
}


@dataclass
class HostModel:
    """What the stand-in's host has: an RDMA device (``CreateBackend(RDMA)`` raises without one)."""

    rdma_device: bool = True


HOST = HostModel()
FAULTS = Faults()

_DESC = instance_of(EngineDesc)
_MEM = instance_of(MemoryDesc)
_STATUS = instance_of(TransferStatus, pointer=True)
_OFFSETS = vector_of(vector_of(SIZE_T))
# Read and Write take the same arguments, as do BatchRead and BatchWrite: (local memory, offset,
# remote memory, offset, size, status, transfer uid), one each or one vector of each.
_ONE_TRANSFER = (
    Param(_MEM),
    Param(SIZE_T),
    Param(_MEM),
    Param(SIZE_T),
    Param(SIZE_T),
    Param(_STATUS),
    Param(UINT64),
)
_BATCH_TRANSFER = (
    Param(vector_of(_MEM)),
    Param(_OFFSETS),
    Param(vector_of(_MEM)),
    Param(_OFFSETS),
    Param(_OFFSETS),
    Param(vector_of(_STATUS)),
    Param(vector_of(UINT64)),
)


class IOEngine:
    """One mori engine of this process, known to peers by its ``EngineDesc``."""

    __slots__ = (
        "_desc",
        "_lock",
        "_backends",
        "_remotes",
        "_regions",
        "_next_mem_id",
        "_next_uid",
        "_failures",
        "_dead_peers",
        "_device_dead",
        "_inbound",
        "_modules",
        "_nic",
        "__weakref__",
    )

    @signature("IOEngine", Param(STR), Param(instance_of(IOEngineConfig)))
    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self._desc = EngineDesc.made(
            key, socket.gethostname(), socket.gethostname(), config.host, config.port, os.getpid()
        )
        self._lock = threading.Lock()
        self._backends: dict[int, dict] = {}
        self._remotes: dict[str, EngineDesc] = {}
        self._regions = RegionTable()
        self._next_mem_id = 0
        self._next_uid = 0
        self._failures: deque[PeerFailureEvent] = deque()
        self._dead_peers: set[str] = set()
        self._device_dead = False
        self._inbound: dict[tuple[str, int], int] = {}
        self._modules: list[str] = []
        self._nic: NicListener | None = None
        add_engine(self)
        _log.info("[mori stand-in] IOEngine %r made (a stand-in for native mori, not AMD's)", key)

    # -- backends --------------------------------------------------------------------------------

    @signature("IOEngine", returns="mori.cpp.EngineDesc")
    def GetEngineDesc(self) -> EngineDesc:
        return EngineDesc.unpack(self._desc.pack())

    @signature("IOEngine", Param(enum_of(BackendType)), Param(instance_of(BackendConfig)))
    def CreateBackend(self, kind, config) -> None:
        kind = int(kind)
        with self._lock:
            if kind in self._backends:
                _log.warning(
                    "[mori stand-in] Backend type %d already exists, skip duplicate creation", kind
                )
                return
            expected = _CONFIG_OF.get(kind)
            if expected is None:
                raise RuntimeError(
                    f"stand-in: backend type {kind} is not one mori implements (native asserts)"
                )
            if not isinstance(config, expected):
                raise RuntimeError(
                    f"stand-in: backend type {kind} given a {type(config).__name__}; native mori "
                    f"would read it as a {expected.__name__}"
                )
            if kind == _RDMA:
                self._make_rdma(config)
            elif kind == _XGMI:
                self._backends[_XGMI] = _fields(config, ("num_streams", "num_events"))
            else:
                raise RuntimeError(
                    "FABRIC needs GPU memory on a scale-up fabric; the stand-in host has none"
                )

    def _make_rdma(self, config: RdmaBackendConfig) -> None:
        if not HOST.rdma_device:
            if os.environ.get("MORI_DISABLE_AUTO_XGMI", "")[:1] == "0":
                raise RuntimeError(
                    "no active RDMA device and no usable GPU P2P; cannot create any backend"
                )
            raise RuntimeError(
                "no active RDMA device on this host; set MORI_DISABLE_AUTO_XGMI=0 to enable "
                "XGMI-only fallback"
            )
        if self._desc.port == _XGMI_ONLY_PORT:
            raise RuntimeError(
                f"IOEngineConfig.port={_XGMI_ONLY_PORT} is reserved as XGMI-only fallback sentinel"
            )
        self._listen()
        self._backends[_RDMA] = _fields(
            config,
            (
                "qp_per_transfer",
                "post_batch_size",
                "num_worker_threads",
                "poll_cq_mode",
                "enable_notification",
            ),
        )

    def _listen(self) -> None:
        """Bind the NIC's listener on the engine's host:port (port 0: a free one, then in the descriptor), as
        mori binds its RDMA control port; an empty host listens on loopback only."""
        desc = self._desc
        try:
            nic = NicListener(
                desc.key, desc.host or "127.0.0.1", desc.port, self._regions, _inbound_for(self)
            )
        except OSError as exc:
            raise RuntimeError(
                f"stand-in: cannot listen on {desc.host or '127.0.0.1'}:{desc.port} for the RDMA "
                f"backend ({exc.strerror or exc})"
            ) from None
        self._nic = nic
        weakref.finalize(self, nic.close)
        if desc.port == 0:
            self._desc = EngineDesc.made(*desc._fields()[:4], nic.port, desc.pid)

    @signature("IOEngine", Param(enum_of(BackendType)))
    def RemoveBackend(self, kind) -> None:
        with self._lock:
            self._backends.pop(int(kind), None)

    @signature("IOEngine", Param(STR))
    def LoadScatterGatherModule(self, path: str) -> None:
        self._modules.append(path)

    @signature("IOEngine", Param(STR))
    def LoadFabricCopyModule(self, path: str) -> None:
        self._modules.append(path)

    # -- remote engines and memory ----------------------------------------------------------------

    @signature("IOEngine", Param(_DESC))
    def RegisterRemoteEngine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remotes[desc.key] = EngineDesc.unpack(desc.pack())

    @signature("IOEngine", Param(_DESC))
    def DeregisterRemoteEngine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._remotes.pop(desc.key, None)

    @signature(
        "IOEngine",
        Param(CAPSULE),
        Param(SIZE_T),
        Param(INT),
        Param(enum_of(MemoryLocationType)),
        returns="mori.cpp.MemoryDesc",
    )
    def RegisterMemory(self, address, size: int, device: int, loc) -> MemoryDesc:
        if int(loc) != int(MemoryLocationType.CPU):
            raise RuntimeError(
                "stand-in: only host (CPU) memory can be registered; this host has no GPU"
            )
        if not address:
            raise RuntimeError("stand-in: cannot register a null pointer")
        with self._lock:
            mem_id = self._next_mem_id
            self._next_mem_id = (self._next_mem_id + 1) & 0xFFFFFFFF
        self._regions.add(Region(mem_id, address, size))
        return MemoryDesc.made(
            engine_key=self._desc.key,
            id=mem_id,
            device_id=device,
            data=address,
            size=size,
            loc=int(loc),
            numa_node=0,
        )

    @signature("IOEngine", Param(_MEM))
    def DeregisterMemory(self, desc: MemoryDesc) -> None:
        if desc.engine_key == self._desc.key:
            self._regions.remove(desc.id)

    @signature("IOEngine", returns="int")
    def AllocateTransferUniqueId(self) -> int:
        return self.standin_next_uid()

    # -- sessions and transfers -------------------------------------------------------------------

    @signature("IOEngine", Param(_MEM), Param(_MEM), returns="Optional[mori.cpp.IOEngineSession]")
    def CreateSession(self, local: MemoryDesc, remote: MemoryDesc) -> IOEngineSession | None:
        route = self._route(local, remote)
        return None if route is None else IOEngineSession.made(route)

    def _route(self, local: MemoryDesc, remote: MemoryDesc) -> Route | None:
        """mori's SelectBackend: RDMA serves any pair with a registered remote engine not on port 1; XGMI
        serves GPU memory only."""
        with self._lock:
            peer = self._remotes.get(remote.engine_key)
            rdma = _RDMA in self._backends
        if not rdma or peer is None or peer.port == _XGMI_ONLY_PORT:
            return None
        return Route(
            self,
            Region(local.id, local.data, local.size),
            RemoteRegion(
                peer.key,
                peer.host,
                peer.port,
                peer.pid,
                Region(remote.id, remote.data, remote.size),
            ),
        )

    @signature("IOEngine", *_ONE_TRANSFER)
    def Read(self, local, local_offset, remote, remote_offset, size, status, uid) -> None:
        self._post("read", local, [local_offset], remote, [remote_offset], [size], status, uid)

    @signature("IOEngine", *_ONE_TRANSFER)
    def Write(self, local, local_offset, remote, remote_offset, size, status, uid) -> None:
        self._post("write", local, [local_offset], remote, [remote_offset], [size], status, uid)

    @signature("IOEngine", *_BATCH_TRANSFER)
    def BatchRead(
        self, locals_, local_offsets, remotes, remote_offsets, sizes, statuses, uids
    ) -> None:
        self._post_each(
            "read", locals_, local_offsets, remotes, remote_offsets, sizes, statuses, uids
        )

    @signature("IOEngine", *_BATCH_TRANSFER)
    def BatchWrite(
        self, locals_, local_offsets, remotes, remote_offsets, sizes, statuses, uids
    ) -> None:
        self._post_each(
            "write", locals_, local_offsets, remotes, remote_offsets, sizes, statuses, uids
        )

    def _post_each(
        self, op, locals_, local_offsets, remotes, remote_offsets, sizes, statuses, uids
    ) -> None:
        lengths = {
            len(v) for v in (locals_, local_offsets, remotes, remote_offsets, sizes, statuses, uids)
        }
        if len(lengths) != 1:
            raise RuntimeError(
                "stand-in: the batch's vectors differ in length; native mori only asserts, and "
                "reads past the shorter ones"
            )
        for item in zip(locals_, local_offsets, remotes, remote_offsets, sizes, statuses, uids):
            local, lo, remote, ro, size, status, uid = item
            self._post(op, local, lo, remote, ro, size, status, uid)

    def _post(self, op, local, local_offsets, remote, remote_offsets, sizes, status, uid) -> None:
        if status is None:
            raise RuntimeError(
                "stand-in: no TransferStatus (None); native mori would dereference a null pointer"
            )
        route = self._route(local, remote)
        if route is None:
            status.update(_ERR_BAD_STATE, "No available backend found, create backend first")
            return
        post_batch(route, op, local_offsets, remote_offsets, sizes, status, uid)

    @signature("IOEngine", Param(STR), Param(UINT64), Param(_STATUS), returns="bool")
    def PopInboundTransferStatus(self, key: str, uid: int, status) -> bool:
        with self._lock:
            code = self._inbound.pop((key, uid), None)
        if code is None:
            return False
        if status is not None:
            status.set_code(code)
        return True

    @signature("IOEngine", returns="Optional[mori.cpp.PeerFailureEvent]")
    def PopPeerFailure(self) -> PeerFailureEvent | None:
        with self._lock:
            return self._failures.popleft() if self._failures else None

    @signature(
        "IOEngine",
        Param(vector_of(_STATUS), "statuses"),
        Param(INT, "timeout_ms", -1),
        returns="mori.cpp.StatusCode",
    )
    def WaitAll(self, statuses, timeout_ms: int):
        return StatusCode.fresh(wait_all(statuses, timeout_ms))

    # -- the stand-in's own -----------------------------------------------------------------------

    @property
    def standin_key(self) -> str:
        return self._desc.key

    @property
    def standin_regions(self) -> RegionTable:
        return self._regions

    def standin_backends(self) -> dict[str, dict]:
        """The backends made so far, by name, with the config values mori got."""
        with self._lock:
            return {
                BackendType.fresh(kind).name: dict(values)
                for kind, values in self._backends.items()
            }

    def standin_notifications(self) -> bool:
        with self._lock:
            rdma = self._backends.get(_RDMA)
        return bool(rdma and rdma["enable_notification"])

    def standin_fault(self, op: str):
        return FAULTS.take(self._desc.key, op, self.standin_notifications())

    def standin_next_uid(self) -> int:
        # mori's transfer uid counter is an atomic<uint32_t> from 0.
        with self._lock:
            uid, self._next_uid = self._next_uid, (self._next_uid + 1) & 0xFFFFFFFF
        return uid

    def standin_answers_at(self, host: str, port: int, pid: int) -> bool:
        return (self._desc.host, self._desc.port, self._desc.pid) == (host, port, pid)

    def standin_peer_alive(self, remote_key: str) -> bool:
        with self._lock:
            return not self._device_dead and remote_key not in self._dead_peers

    def standin_report_peer_failure(
        self,
        remote_key: str,
        reason=PeerFailureReason.PEER_UNREACHABLE,
        detail: str = "injected (stand-in)",
    ) -> None:
        """Record a failure of the peer ``remote_key`` ("" for the whole device), as mori's async event monitor
        would: queue pairs to it are dead from now on, and ``PopPeerFailure`` hands the event out."""
        with self._lock:
            if remote_key:
                self._dead_peers.add(remote_key)
            else:
                self._device_dead = True
            if len(self._failures) < _MAX_PENDING_FAILURES:
                self._failures.append(PeerFailureEvent.made(remote_key, reason, detail=detail))

    def standin_peer_unreachable(self, remote_key: str, detail: str) -> None:
        self.standin_report_peer_failure(remote_key, PeerFailureReason.PEER_UNREACHABLE, detail)

    def standin_inbound(self, initiator_key: str, uid: int) -> None:
        with self._lock:
            self._inbound[(initiator_key, uid)] = 0

    def __repr__(self) -> str:
        return f"<mori.cpp.IOEngine object (stand-in) key={self._desc.key!r}>"


def _inbound_for(engine: IOEngine):
    """What the listener calls when a notified write landed: the engine's record, while the engine lives."""
    ref = weakref.ref(engine)

    def inbound(initiator_key: str, uid: int) -> None:
        target = ref()
        if target is not None:
            target.standin_inbound(initiator_key, uid)

    return inbound


def _fields(config, names: tuple[str, ...]) -> dict:
    return {name: getattr(config, name) for name in names}


def wait_all(statuses: list, timeout_ms: int) -> int:
    """mori's ``IOEngine::WaitAll``: the first failure wins; IN_PROGRESS when a bounded wait runs out."""
    statuses = [status for status in statuses if status is not None]
    first_error = 0
    if timeout_ms <= 0:
        pending = False
        for status in statuses:
            code = status.wait_code(timeout_ms)
            pending = pending or code == 2
            if code not in (0, 2) and first_error == 0:
                first_error = code
                if timeout_ms == 0:
                    return code
        return first_error or (2 if pending and timeout_ms == 0 else 0)
    deadline = time.monotonic() + timeout_ms / 1000.0
    for status in statuses:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return first_error or 2
        code = status.wait_code(min(left_ms, (1 << 31) - 1))
        if code == 2:
            return first_error or 2
        if code != 0 and first_error == 0:
            first_error = code
    return first_error
