"""MoriEngine: the TransferEngine interface over AMD's mori.io (RDMA or XGMI), an optional extra (``mori``, pinned
to amd-mori 1.2.4) imported lazily.

Rules: ``probe_mori`` never crashes this process; every argument is checked before native code, against the C++
types mori's bindings take (some bad values abort inside mori); every status mori may still write into stays
referenced for the life of the engine (``mori_status.py``), and a failure whose writes may still land is never
reported final; notifications are off unless asked for, as vLLM's connector has them.
"""

from __future__ import annotations

import collections
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import MoriioFsmError
from .base import SessionBase
from .checks import CheckedBatch, require_bytes
from .interface import TransferEngine
from .mori_status import C_INT_MAX, MoriStatus, StatusKeeper
from .probe import Availability, ImportProbe
from .status import StatusCode, TransferStatus, failed_status, wait_all

__all__ = [
    "MoriAvailability",
    "MoriEngine",
    "MoriSession",
    "MoriUnavailableError",
    "PeerFailure",
    "mori_availability",
    "probe_mori",
]

_log = logging.getLogger(__name__)


class MoriUnavailableError(MoriioFsmError, RuntimeError):
    """mori.io cannot be used in this process; the message says why."""


MoriAvailability = Availability

#: ``probe_mori(isolated=False, timeout_s=60.0)``: whether ``mori.io`` imports here (cached for the process).
probe_mori = ImportProbe("mori.io", "mori.io", "mori.io is not installed: {exc}")


#: ``MORIIO_FSM_MORI=standin`` lets MoriEngine load the mori stand-in (``mori_standin``) where no real mori.io
#: imports: for tests, benchmarks and demos on hosts without AMD hardware; it never replaces a real mori.
STANDIN_SWITCH = "MORIIO_FSM_MORI"


def _mori_io():
    choice = os.environ.get(STANDIN_SWITCH, "")
    if choice == "standin":
        _load_standin()
    elif choice not in ("", "native"):
        raise MoriUnavailableError(
            f"{STANDIN_SWITCH} must be 'standin', 'native' or unset, got {choice!r}"
        )
    availability = probe_mori()
    if not availability.available:
        raise MoriUnavailableError(availability.reason)
    return importlib.import_module("mori.io")


def mori_availability(**probe_options: Any) -> Availability:
    """Whether a MoriEngine can be made here: a mori.io that imports, or with ``MORIIO_FSM_MORI=standin``
    the stand-in over the pinned wheel (fetched now if need be). ``probe_options`` go to ``probe_mori``."""
    try:
        if os.environ.get(STANDIN_SWITCH, "") in ("", "native"):
            return probe_mori(**probe_options)
        _mori_io()
    except MoriUnavailableError as exc:
        return Availability(False, str(exc))
    return Availability(True, "mori.io over the stand-in" if _standin_loaded() else "mori.io")


def _standin_loaded() -> bool:
    return bool(getattr(sys.modules.get("mori.cpp"), "__standin__", False))


def _load_standin() -> None:
    # Only when asked: it fetches amd-mori's wheel.
    from .mori_standin.loader import StandInRefused, is_loaded, load_mori_io
    from .mori_standin.wheel import WheelMismatch, WheelUnavailable

    if is_loaded():
        return
    try:
        load_mori_io()
    except StandInRefused as exc:
        if "imports for real" not in str(exc):
            raise MoriUnavailableError(f"{STANDIN_SWITCH}=standin: {exc}") from exc
        return  # a real mori is here: it is used, never shadowed
    except (WheelUnavailable, WheelMismatch, ValueError) as exc:
        raise MoriUnavailableError(f"{STANDIN_SWITCH}=standin: {exc}") from exc
    probe_mori.forget()


@dataclass(frozen=True, slots=True)
class PeerFailure:
    """A failure mori reported of a peer, or of what reaches it (``remote_engine_key`` "" : the local port or
    device, so every peer)."""

    remote_engine_key: str
    reason: str
    detail: str
    device_name: str = ""


class MoriSession(SessionBase):
    """A mori ``IOEngineSession`` between one local and one remote memory region.

    ``killable`` stays False: mori cannot stop a posted transfer, so the machines keep the blocks of a torn-down
    transfer out of use.
    """

    def __init__(self, engine: MoriEngine, raw: Any, local_mem: Any, remote_mem: Any) -> None:
        super().__init__(engine, local_mem, remote_mem)
        self._raw = raw

    def allocate_transfer_uid(self) -> int:
        return int(self._raw.allocate_transfer_uid())

    def alive(self) -> bool:
        """False once the engine closed or mori reported its peer (or the local device) failed.

        mori hears of a peer's loss only through its own queue pairs: a writer learns it when a write times out,
        a passive target (D in WRITE mode) never does. True therefore means "no failure seen", not "the peer is
        there"; the machines' timeouts end a transfer whose peer went silent.
        """
        engine = self._engine
        return (
            not engine.closed
            and bool(self._raw.alive())
            and engine.peer_alive(self.remote_engine_key)
        )

    # The project's own engines hand back LocalTransferStatus; mori's statuses are its own.
    def _submit(self, op: str, checked: CheckedBatch) -> TransferStatus:  # type: ignore[override]
        if self._engine.closed:
            return failed_status(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine is closed")
        problem = _native_range_problem(checked)
        if problem is not None:
            return failed_status(StatusCode.ERR_INVALID_ARGS, f"batch_{op}: {problem}")
        post = self._raw.batch_write if op == "write" else self._raw.batch_read
        status = MoriStatus(
            post(checked.local_offsets, checked.remote_offsets, checked.sizes, checked.transfer_uid)
        )
        self._engine._kept.keep(status)
        return status


_UINT32_MAX = (1 << 32) - 1
_UINT64_MAX = (1 << 64) - 1


def _native_range_problem(checked: CheckedBatch) -> str | None:
    """What mori's bindings or checks would refuse in a batch our own checks passed."""
    if checked.transfer_uid > _UINT64_MAX:
        return f"transfer_uid {checked.transfer_uid} does not fit mori's uint64 transfer ids"
    largest = max(checked.sizes)
    if largest > _UINT32_MAX:
        return (
            f"sizes[{checked.sizes.index(largest)}] is {largest}; mori takes at most {_UINT32_MAX} bytes "
            "per range (split it)"
        )
    return None


_POLL_MODES = ("polling", "event")
_BACKENDS = ("rdma", "xgmi")
_XGMI_ONLY_PORT = (
    1  # mori's sentinel port of its XGMI-only fallback; CreateBackend(RDMA) refuses it
)
_PEER_FAILURES_KEPT = 1024


def _c_int(name: str, value: Any, *, minus_one: bool = False) -> int:
    """A positive C++ int (or -1, mori's "default", where ``minus_one``); anything else is a ``ValueError``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (1 <= value <= C_INT_MAX or (minus_one and value == -1))
    ):
        also = " or -1 (mori's default)" if minus_one else ""
        raise ValueError(f"{name} must be an integer from 1 to {C_INT_MAX}{also}, got {value!r}")
    return value


def _check_endpoint(key: Any, host: Any, port: Any) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"engine key must be a non-empty string, got {key!r}")
    if not isinstance(host, str):
        raise ValueError(f"host must be a string, got {type(host).__name__}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in 0..65535, got {port!r}")
    if port == _XGMI_ONLY_PORT:
        raise ValueError(
            "port 1 is reserved by mori.io (the sentinel of its XGMI-only fallback); use 0 for a port "
            "of the system's choosing, or another port"
        )


class MoriEngine(TransferEngine):
    """A mori.io ``IOEngine`` with an RDMA backend (``backend="rdma"``) or an XGMI one (``"xgmi"``).

    Raises ``MoriUnavailableError`` when mori.io does not import (with the probe's reason) or cannot make the
    backend here (an RDMA backend needs an RDMA device), ``ValueError`` for a bad configuration value.
    Descriptors are mori's own ``EngineDesc``/``MemoryDesc`` objects (``pack()`` -> bytes). XGMI moves GPU memory
    within one node only: for host tensors its ``create_session`` answers None.
    """

    def __init__(
        self,
        key: str,
        host: str = "",
        port: int = 0,
        *,
        backend: str = "rdma",
        qp_per_transfer: int = 1,
        post_batch_size: int = -1,
        num_worker_threads: int = -1,
        poll_cq_mode: str = "polling",
        enable_notification: bool = False,
        num_streams: int = 64,
        num_events: int = 64,
    ) -> None:
        _check_endpoint(key, host, port)
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if poll_cq_mode not in _POLL_MODES:
            raise ValueError(f"poll_cq_mode must be one of {_POLL_MODES}, got {poll_cq_mode!r}")
        if not isinstance(enable_notification, bool):
            raise ValueError(
                f"enable_notification must be True or False, got {enable_notification!r}"
            )
        rdma = (
            _c_int("qp_per_transfer", qp_per_transfer),
            _c_int("post_batch_size", post_batch_size, minus_one=True),
            _c_int("num_worker_threads", num_worker_threads, minus_one=True),
        )
        xgmi = (_c_int("num_streams", num_streams), _c_int("num_events", num_events))
        io = _mori_io()
        self._io = io
        self.key = key
        self.backend = backend
        self._closed = False
        self._failures_lock = threading.Lock()
        self._peer_failures: collections.deque[PeerFailure] = collections.deque(
            maxlen=_PEER_FAILURES_KEPT
        )
        self._failed_peers: set[str] = set()
        # Made before the keeper: when this object goes, mori's engine (and its completion threads) goes first,
        # then the statuses it could write into.
        self._engine = io.IOEngine(key, io.IOEngineConfig(host, port))
        self._kept = StatusKeeper()
        if backend == "rdma":
            mode = io.PollCqMode.POLLING if poll_cq_mode == "polling" else io.PollCqMode.EVENT
            self._create_backend(
                io.BackendType.RDMA, io.RdmaBackendConfig(*rdma, mode, enable_notification)
            )
        else:
            self._create_backend(io.BackendType.XGMI, io.XgmiBackendConfig(*xgmi))

    def _create_backend(self, kind: Any, config: Any) -> None:
        try:
            self._engine.create_backend(kind, config)
        except RuntimeError as exc:
            raise MoriUnavailableError(
                f"mori.io could not make its {self.backend} backend here: {exc}"
            ) from exc

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight_count(self) -> int:
        """Statuses posted through this engine that mori may still write into (in flight, or failed while some
        of their writes may still land)."""
        return len(self._kept)

    def get_engine_desc(self):
        return self._engine.get_engine_desc()

    def unpack_engine_desc(self, packed: bytes):
        return self._io.EngineDesc.unpack(require_bytes("engine descriptor", packed))

    def unpack_memory_desc(self, packed: bytes):
        return self._io.MemoryDesc.unpack(require_bytes("memory descriptor", packed))

    def register_remote_engine(self, desc) -> None:
        self._require(desc, self._io.EngineDesc, "desc")
        self._engine.register_remote_engine(desc)
        with self._failures_lock:
            self._failed_peers.discard(
                desc.key
            )  # a peer registered again starts with a clean record

    def deregister_remote_engine(self, desc) -> None:
        self._require(desc, self._io.EngineDesc, "desc")
        self._engine.deregister_remote_engine(desc)

    def register_torch_tensor(self, tensor):
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"mori.io registers CPU or GPU memory; the tensor is on {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"tensor of shape {tuple(tensor.shape)} must be contiguous to be registered"
            )
        if tensor.numel() == 0:
            raise ValueError("an empty tensor cannot be registered")
        return self._engine.register_torch_tensor(tensor)

    def deregister_memory(self, mem) -> None:
        self._require(mem, self._io.MemoryDesc, "mem")
        self._engine.deregister_memory(mem)

    def allocate_transfer_uid(self) -> int:
        return int(self._engine.allocate_transfer_uid())

    def create_session(self, local_mem, remote_mem) -> MoriSession | None:
        self._require(local_mem, self._io.MemoryDesc, "local_mem")
        self._require(remote_mem, self._io.MemoryDesc, "remote_mem")
        raw = self._engine.create_session(local_mem, remote_mem)
        if raw is None:
            return None
        return MoriSession(self, raw, local_mem, remote_mem)

    def wait_all(self, statuses: Iterable[TransferStatus], timeout_ms: int = -1) -> bool:
        """True when every status is final within ``timeout_ms``; a failure whose writes may still land never is."""
        statuses = list(statuses)
        return wait_all(statuses, timeout_ms) and not any(
            s.init() or s.in_progress() for s in statuses
        )

    # -- what mori says of its peers ------------------------------------------------------------------

    def peer_failures(self) -> list[PeerFailure]:
        """The peer failures mori reported to this engine so far (the last 1024), oldest first."""
        self._take_peer_failures()
        with self._failures_lock:
            return list(self._peer_failures)

    def peer_alive(self, remote_engine_key: str) -> bool:
        """False once mori reported a failure of that peer, or of the local port or device, since it was last
        registered."""
        self._take_peer_failures()
        with self._failures_lock:
            return "" not in self._failed_peers and remote_engine_key not in self._failed_peers

    def _take_peer_failures(self) -> None:
        pop = getattr(self._engine, "pop_peer_failure", None)  # new in amd-mori 1.2.4
        if pop is None or self._closed:
            return
        while (event := pop()) is not None:
            failure = PeerFailure(
                str(event.remote_engine_key),
                str(event.reason.name),
                str(event.detail),
                str(event.device_name),
            )
            _log.warning(
                "mori engine %r: peer %r failed (%s): %s",
                self.key,
                failure.remote_engine_key or "*",
                failure.reason,
                failure.detail,
            )
            with self._failures_lock:
                self._peer_failures.append(failure)
                self._failed_peers.add(failure.remote_engine_key)

    def close(self) -> None:
        """Mark the engine closed; mori frees its native state when it is collected.

        Every status mori may still write into stays referenced by this object, after close too.
        """
        self._closed = True

    @staticmethod
    def _require(value: Any, kind: type, name: str) -> None:
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a mori {kind.__name__}, got {type(value).__name__}")
