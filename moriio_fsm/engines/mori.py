"""MoriEngine: the TransferEngine interface over AMD's mori.io (RDMA), an optional extra (``mori``) imported lazily.

Rules: ``probe_mori`` never crashes this process; every argument is checked before native code (some bad values
abort inside mori); every in-flight status stays referenced until it is final, as mori requires.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from ..errors import MoriioFsmError
from .base import SessionBase
from .checks import CheckedBatch, require_bytes
from .interface import TransferEngine
from .probe import Availability, ImportProbe
from .status import StatusCode, TransferStatus, code_is_failure, failed_status

__all__ = ["MoriAvailability", "MoriEngine", "MoriSession", "MoriUnavailableError", "probe_mori"]


class MoriUnavailableError(MoriioFsmError, RuntimeError):
    """mori.io cannot be used in this process; the message says why."""


MoriAvailability = Availability

#: ``probe_mori(isolated=False, timeout_s=60.0)``: whether ``mori.io`` imports here (cached for the process).
probe_mori = ImportProbe("mori.io", "mori.io", "mori.io is not installed: {exc}")


def _mori_io():
    availability = probe_mori()
    if not availability.available:
        raise MoriUnavailableError(availability.reason)
    return importlib.import_module("mori.io")


class MoriStatus:
    """Our status surface over a mori ``TransferStatus`` (CamelCase methods)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def code(self) -> int:
        return int(self._raw.Code())

    def message(self) -> str:
        return str(self._raw.Message())

    def init(self) -> bool:
        return bool(self._raw.Init())

    def in_progress(self) -> bool:
        return bool(self._raw.InProgress())

    def succeeded(self) -> bool:
        return bool(self._raw.Succeeded())

    def failed(self) -> bool:
        return bool(self._raw.Failed())

    def is_final(self) -> bool:
        code = self.code()
        return code == StatusCode.SUCCESS or code_is_failure(code)

    def wait(self) -> int:
        self._raw.Wait()
        return self.code()

    def wait_for(self, timeout_ms: int = -1) -> bool:
        timeout_ms = -1 if timeout_ms is None or timeout_ms < 0 else int(timeout_ms)
        self._raw.WaitFor(timeout_ms)
        return self.is_final()

    def __repr__(self) -> str:
        return f"<MoriStatus code={self.code()} {self.message()!r}>"


class _InFlight:
    """Statuses mori may still write to; each is dropped only once it is final.

    ``keep`` is amortised O(1): the list is pruned only when it has doubled since
    the last prune, so each post pays for at most a couple of status queries
    however many transfers are in flight, and memory stays within twice the
    number really in flight.
    """

    _MIN_PRUNE_AT = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: list[MoriStatus] = []
        self._prune_at = self._MIN_PRUNE_AT

    def keep(self, status: MoriStatus) -> None:
        with self._lock:
            self._live.append(status)
            if len(self._live) >= self._prune_at:
                self._prune()

    def _prune(self) -> None:
        self._live = [s for s in self._live if not s.is_final()]
        self._prune_at = max(2 * len(self._live), self._MIN_PRUNE_AT)

    def __len__(self) -> int:
        with self._lock:
            self._prune()
            return len(self._live)

    def snapshot(self) -> list[MoriStatus]:
        with self._lock:
            return list(self._live)


class MoriSession(SessionBase):
    """A mori ``IOEngineSession`` between one local and one remote memory region."""

    def __init__(self, engine: "MoriEngine", raw: Any, local_mem: Any, remote_mem: Any) -> None:
        super().__init__(engine, local_mem, remote_mem)
        self._raw = raw

    def allocate_transfer_uid(self) -> int:
        return int(self._raw.allocate_transfer_uid())

    def alive(self) -> bool:
        return not self._engine.closed and bool(self._raw.alive())

    def _submit(self, op: str, checked: CheckedBatch) -> TransferStatus:
        if self._engine.closed:
            return failed_status(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine is closed")
        post = self._raw.batch_write if op == "write" else self._raw.batch_read
        status = MoriStatus(post(checked.local_offsets, checked.remote_offsets, checked.sizes, checked.transfer_uid))
        self._engine._in_flight.keep(status)
        return status


_POLL_MODES = ("polling", "event")


class MoriEngine(TransferEngine):
    """A mori.io ``IOEngine`` with an RDMA backend.

    Raises ``MoriUnavailableError`` (with the probe's reason) when mori.io does
    not import, ``ValueError`` for a bad configuration value. Descriptors are
    mori's own ``EngineDesc``/``MemoryDesc`` objects (``pack()`` -> bytes).
    """

    def __init__(self, key: str, host: str = "", port: int = 0, *,
                 qp_per_transfer: int = 1, post_batch_size: int = -1,
                 num_worker_threads: int = -1, poll_cq_mode: str = "polling",
                 enable_notification: bool = True) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"engine key must be a non-empty string, got {key!r}")
        if not isinstance(host, str):
            raise ValueError(f"host must be a string, got {type(host).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in 0..65535, got {port!r}")
        if isinstance(qp_per_transfer, bool) or not isinstance(qp_per_transfer, int) or qp_per_transfer < 1:
            raise ValueError(f"qp_per_transfer must be a positive integer, got {qp_per_transfer!r}")
        for name, value in (("post_batch_size", post_batch_size), ("num_worker_threads", num_worker_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
                raise ValueError(f"{name} must be a positive integer or -1 (mori's default), got {value!r}")
        if poll_cq_mode not in _POLL_MODES:
            raise ValueError(f"poll_cq_mode must be one of {_POLL_MODES}, got {poll_cq_mode!r}")
        io = _mori_io()
        self._io = io
        self.key = key
        self._closed = False
        self._in_flight = _InFlight()
        self._memory_sizes: dict[Any, int] = {}
        self._engine = io.IOEngine(key, io.IOEngineConfig(host, port))
        mode = io.PollCqMode.POLLING if poll_cq_mode == "polling" else io.PollCqMode.EVENT
        self._engine.create_backend(
            io.BackendType.RDMA,
            io.RdmaBackendConfig(qp_per_transfer, post_batch_size, num_worker_threads, mode,
                                 bool(enable_notification)),
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight_count(self) -> int:
        """Statuses posted through this engine that are not final yet."""
        return len(self._in_flight)

    def get_engine_desc(self):
        return self._engine.get_engine_desc()

    def unpack_engine_desc(self, packed: bytes):
        return self._io.EngineDesc.unpack(require_bytes("engine descriptor", packed))

    def unpack_memory_desc(self, packed: bytes):
        return self._io.MemoryDesc.unpack(require_bytes("memory descriptor", packed))

    def register_remote_engine(self, desc) -> None:
        self._require(desc, self._io.EngineDesc, "desc")
        self._engine.register_remote_engine(desc)

    def deregister_remote_engine(self, desc) -> None:
        self._require(desc, self._io.EngineDesc, "desc")
        self._engine.deregister_remote_engine(desc)

    def register_torch_tensor(self, tensor):
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"mori.io registers CPU or GPU memory; the tensor is on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} must be contiguous to be registered")
        if tensor.numel() == 0:
            raise ValueError("an empty tensor cannot be registered")
        desc = self._engine.register_torch_tensor(tensor)
        return desc

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

    def close(self) -> None:
        """Mark the engine closed; mori frees its native state when it is collected.

        Statuses still in flight stay referenced by this object, so it keeps them
        alive until they are final even after close.
        """
        self._closed = True

    @staticmethod
    def _require(value: Any, kind: type, name: str) -> None:
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a mori {kind.__name__}, got {type(value).__name__}")
