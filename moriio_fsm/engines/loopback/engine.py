"""LoopbackEngine: mori.io's stand-in, moving real bytes in one process or one-sidedly into a peer's shared memory.

Rules: mori's status semantics (posting returns at once, a worker thread settles each status, bad values give
failed statuses); faults come from ``engine.faults`` (``faults.py``), asked only through its public methods.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import itertools
from itertools import repeat
import logging
import operator
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from ..interface import (
    ArgumentProblem,
    TransferEngine,
    CheckedBatch,
    TransferSession,
    check_transfer_batch,
    require_bytes,
)
from ..faults import InjectedFailure, LoopbackFaults, PostedTransfer
from ..shared_memory import PeerMapping, RegionUnavailable, SharedRegion, peer_region_problem
from ..status import LocalTransferStatus, StatusCode, failed_status

__all__ = [
    "LoopbackEngine",
    "LoopbackSession",
    "LoopbackEngineDesc",
    "LoopbackMemoryDesc",
]

_log = logging.getLogger(__name__)

_ENGINE_DESC_KIND = "moriio-loopback-engine"
_MEMORY_DESC_KIND = "moriio-loopback-memory"
_NOT_SHARED = -1

# Registered memory of every live LoopbackEngine in this process, so that an
# engine can reach a peer engine's memory in the same process without sharing.
_process_memory: dict[tuple[str, int], torch.Tensor] = {}
_process_engine_keys: set[str] = set()
_process_lock = threading.Lock()

_memmove = ctypes.memmove  # a foreign call: it runs without holding the GIL


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
            {"kind": _ENGINE_DESC_KIND, "key": self.key, "pid": self.pid,
             "hostname": self.hostname, "host": self.host, "port": self.port}
        )

    @classmethod
    def unpack(cls, packed: bytes) -> "LoopbackEngineDesc":
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

    _FIELDS = ("engine_key", "mem_id", "size", "pid", "region_fd", "region_token",
               "region_offset", "dtype", "shape")

    @property
    def shared(self) -> bool:
        return self.region_fd != _NOT_SHARED

    def pack(self) -> bytes:
        body = {name: getattr(self, name) for name in self._FIELDS}
        body["shape"] = list(self.shape)
        body["kind"] = _MEMORY_DESC_KIND
        return msgpack.packb(body)

    @classmethod
    def unpack(cls, packed: bytes) -> "LoopbackMemoryDesc":
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for malformed bytes."""
        fields = _unpack_fields("memory descriptor", _MEMORY_DESC_KIND, packed, cls._FIELDS)
        values = {name: fields[name] for name in cls._FIELDS}
        values["shape"] = tuple(values["shape"])
        return cls(**values)


@dataclass(order=True, slots=True)
class _Job:
    due: float
    sequence: int
    status: LocalTransferStatus = field(compare=False)
    session: "LoopbackSession" = field(compare=False)
    op: str = field(compare=False)
    batch: CheckedBatch = field(compare=False)
    failure: InjectedFailure | None = field(compare=False)


class LoopbackSession(TransferSession):
    """A channel from a local region to a remote region, in this process or a peer's."""

    def __init__(self, engine: "LoopbackEngine", local: LoopbackMemoryDesc,
                 remote: LoopbackMemoryDesc, local_bytes: torch.Tensor,
                 remote_bytes: torch.Tensor) -> None:
        self._engine = engine
        self.local_mem = local
        self.remote_mem = remote
        self.remote_engine_key = remote.engine_key
        # Holding the byte views keeps both mappings alive while jobs use raw addresses.
        self._local_bytes = local_bytes
        self._remote_bytes = remote_bytes
        self._local_address = local_bytes.data_ptr()
        self._remote_address = remote_bytes.data_ptr()

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("write", local_offsets, remote_offsets, sizes, transfer_uid)

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("read", local_offsets, remote_offsets, sizes, transfer_uid)

    def kill(self) -> None:
        """Break this session (same as ``engine.faults.kill_session(self)``)."""
        self._engine.faults.kill_session(self)

    def alive(self) -> bool:
        return self._why_dead() is None

    def _why_dead(self) -> str | None:
        if self._engine.closed:
            return "engine is closed"
        reason = self._engine.faults.session_fault(self)
        if reason is not None:
            return reason
        return self._engine._remote_gone(self.remote_mem)

    def _post(self, op, local_offsets, remote_offsets, sizes, transfer_uid):
        checked = check_transfer_batch(
            local_offsets, remote_offsets, sizes, transfer_uid,
            local_size=self.local_mem.size, remote_size=self.remote_mem.size,
        )
        if isinstance(checked, ArgumentProblem):
            return failed_status(checked.code, f"batch_{op}: {checked.message}")
        return self._engine._submit(self, op, checked)

    def _execute(self, job: _Job) -> None:
        batch = job.batch
        if job.op == "write":
            src, dst = self._local_address, self._remote_address
            src_offsets, dst_offsets = batch.local_offsets, batch.remote_offsets
        else:
            src, dst = self._remote_address, self._local_address
            src_offsets, dst_offsets = batch.remote_offsets, batch.local_offsets
        self._engine._copy(dst, src, dst_offsets, src_offsets, batch.sizes, batch.total_bytes)


def _copy_ranges(dst: int, src: int, dst_offsets: list[int], src_offsets: list[int],
                 sizes: list[int]) -> None:
    """Copy each range; ranges adjacent on both sides go as one larger copy.

    The per-range work runs inside ``map`` (C loops), because with 64 KiB ranges
    Python bytecode per range would cost a noticeable share of the copy itself.
    """
    dst_ends = list(map(operator.add, dst_offsets, sizes))
    src_ends = list(map(operator.add, src_offsets, sizes))
    follows_on = list(map(operator.and_,
                          map(operator.eq, dst_offsets[1:], dst_ends),
                          map(operator.eq, src_offsets[1:], src_ends)))
    if any(follows_on):
        starts = [0] + [i + 1 for i, joined in enumerate(follows_on) if not joined]
        last = [i - 1 for i in starts[1:]] + [len(sizes) - 1]
        dst_offsets = [dst_offsets[i] for i in starts]
        src_offsets = [src_offsets[i] for i in starts]
        sizes = [dst_ends[j] - dst_offsets[k] for k, j in enumerate(last)]
    deque(map(_memmove,
              map(operator.add, repeat(dst), dst_offsets),
              map(operator.add, repeat(src), src_offsets),
              sizes), maxlen=0)


class LoopbackEngine(TransferEngine):
    """A transfer engine whose "network" is shared memory on one host.

    Memory from ``allocate_shared_tensor`` can be reached by engines in other
    processes; any other CPU tensor only by engines in this process. Engine keys
    must be unique among live engines of a process. ``close`` fails every
    transfer still queued, stalled or held with ERR_BAD_STATE, stops the worker thread,
    drops every fault rule and releases shared regions this engine allocated.
    """

    # Below this many bytes a batch is copied by the worker alone: handing work
    # to a helper thread costs more than it saves.
    PARALLEL_COPY_MIN_BYTES = 8 << 20

    def __init__(self, key: str, host: str = "", port: int = 0, *,
                 copy_threads: int | None = None) -> None:
        if copy_threads is None:
            copy_threads = min(2, os.cpu_count() or 1)
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or copy_threads < 1:
            raise ValueError(f"copy_threads must be a positive integer, got {copy_threads!r}")
        if not isinstance(key, str) or not key:
            raise ValueError(f"engine key must be a non-empty string, got {key!r}")
        with _process_lock:
            if key in _process_engine_keys:
                raise ValueError(f"a LoopbackEngine with key {key!r} is already live in this process")
            _process_engine_keys.add(key)
        self.key = key
        self.faults = LoopbackFaults()
        self._desc = LoopbackEngineDesc(key, os.getpid(), socket.gethostname(), host, int(port))
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._uids = itertools.count(1)
        self._mem_ids = itertools.count(1)
        self._sequence = 0
        self._queue: list[_Job] = []
        self._stalled: list[_Job] = []
        self._held: dict[int, _Job] = {}
        self._closed = False
        self._regions: list[SharedRegion] = []
        self._memory: dict[int, tuple[LoopbackMemoryDesc, torch.Tensor]] = {}
        self._remote_engines: dict[str, LoopbackEngineDesc] = {}
        self._peer_maps: dict[tuple[int, str], PeerMapping] = {}
        self._copy_threads = copy_threads
        self._copy_helpers: ThreadPoolExecutor | None = None
        self._worker = threading.Thread(target=self._run, name=f"loopback-{key}", daemon=True)
        self._worker.start()

    # -- descriptors and registration ------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def get_engine_desc(self) -> LoopbackEngineDesc:
        return self._desc

    def unpack_engine_desc(self, packed: bytes) -> LoopbackEngineDesc:
        return LoopbackEngineDesc.unpack(packed)

    def unpack_memory_desc(self, packed: bytes) -> LoopbackMemoryDesc:
        return LoopbackMemoryDesc.unpack(packed)

    def register_remote_engine(self, desc: LoopbackEngineDesc) -> None:
        if not isinstance(desc, LoopbackEngineDesc):
            raise TypeError(f"desc must be a LoopbackEngineDesc, got {type(desc).__name__}")
        with self._lock:
            self._remote_engines[desc.key] = desc

    def deregister_remote_engine(self, desc: LoopbackEngineDesc) -> None:
        if not isinstance(desc, LoopbackEngineDesc):
            raise TypeError(f"desc must be a LoopbackEngineDesc, got {type(desc).__name__}")
        with self._lock:
            self._remote_engines.pop(desc.key, None)

    def allocate_shared_tensor(self, shape, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A zeroed CPU tensor in shared memory that peer processes can write into.

        The memory stays valid while the tensor, a view of it or a registration
        of it lives; peers can open it until this engine closes. Once all of
        those are gone the region is released, without waiting for ``close``.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        shape = tuple(int(d) for d in ((shape,) if isinstance(shape, int) else shape))
        if any(d < 0 for d in shape):
            raise ValueError(f"shape must not hold negative sizes, got {shape}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self._require_open("allocate_shared_tensor")
        region, flat = SharedRegion.allocate(max(nbytes, 1))
        with self._lock:
            self._regions = [r for r in self._regions if not r.closed]
            self._regions.append(region)
        return flat[:nbytes].view(dtype).view(shape)

    def register_torch_tensor(self, tensor: torch.Tensor) -> LoopbackMemoryDesc:
        """Register a contiguous CPU tensor; shared only if it came from allocate_shared_tensor.

        Raises ``TypeError`` for a non-tensor and ``ValueError`` for a tensor that
        is not contiguous, not on the CPU or empty.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"LoopbackEngine moves host memory only; the tensor is on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} must be contiguous to be registered")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("an empty tensor cannot be registered")
        self._require_open("register_torch_tensor")
        address = tensor.data_ptr()
        flat = tensor.reshape(-1).view(torch.uint8)
        region = next((r for r in self._regions if not r.closed and r.contains(address, nbytes)), None)
        with self._lock:
            mem_id = next(self._mem_ids)
            desc = LoopbackMemoryDesc(
                engine_key=self.key, mem_id=mem_id, size=nbytes, pid=self._desc.pid,
                region_fd=region.fd if region else _NOT_SHARED,
                region_token=region.token if region else "",
                region_offset=address - region.base_address if region else 0,
                dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape),
            )
            self._memory[mem_id] = (desc, flat)
        with _process_lock:
            _process_memory[(self.key, mem_id)] = flat
        return desc

    def deregister_memory(self, mem: LoopbackMemoryDesc) -> None:
        """Forget a registration; sessions already open keep their view of the memory.

        Memory from ``allocate_shared_tensor`` is released here if nothing else
        (the caller's tensor, a session) still holds it.
        """
        if not isinstance(mem, LoopbackMemoryDesc):
            raise TypeError(f"mem must be a LoopbackMemoryDesc, got {type(mem).__name__}")
        if mem.engine_key != self.key:
            raise ValueError(f"memory {mem.mem_id} belongs to engine {mem.engine_key!r}, not {self.key!r}")
        with self._lock:
            self._memory.pop(mem.mem_id, None)
        with _process_lock:
            _process_memory.pop((self.key, mem.mem_id), None)
        with self._lock:
            self._regions = [r for r in self._regions if not r.closed]

    def allocate_transfer_uid(self) -> int:
        with self._lock:
            return next(self._uids)

    # -- sessions ------------------------------------------------------------
    def create_session(self, local_mem, remote_mem) -> LoopbackSession | None:
        """A session, or None when a region or the remote engine cannot be reached."""
        if not isinstance(local_mem, LoopbackMemoryDesc) or not isinstance(remote_mem, LoopbackMemoryDesc):
            raise TypeError(
                f"create_session needs two LoopbackMemoryDesc, got "
                f"{type(local_mem).__name__} and {type(remote_mem).__name__}"
            )
        if self._closed:
            return None
        with self._lock:
            local = self._memory.get(local_mem.mem_id) if local_mem.engine_key == self.key else None
            remote_engine = self._remote_engines.get(remote_mem.engine_key)
        if local is None:
            _log.warning("create_session: local memory %s is not registered with engine %r",
                         local_mem.mem_id, self.key)
            return None
        if remote_mem.engine_key != self.key and (remote_engine is None or remote_engine.pid != remote_mem.pid):
            _log.warning("create_session: remote engine %r is not registered", remote_mem.engine_key)
            return None
        remote_bytes = self._resolve_remote(remote_mem)
        if remote_bytes is None:
            return None
        return LoopbackSession(self, local[0], remote_mem, local[1], remote_bytes)

    def _resolve_remote(self, remote: LoopbackMemoryDesc) -> torch.Tensor | None:
        if remote.pid == self._desc.pid:
            with _process_lock:
                found = _process_memory.get((remote.engine_key, remote.mem_id))
            if found is None or found.numel() < remote.size:
                _log.warning("create_session: memory %s of engine %r is not registered",
                             remote.mem_id, remote.engine_key)
                return None
            return found
        if not remote.shared:
            _log.warning("create_session: memory %s of engine %r is not shared memory; only "
                         "tensors from allocate_shared_tensor can be reached across processes",
                         remote.mem_id, remote.engine_key)
            return None
        self._drop_dead_peer_maps()
        cache_key = (remote.pid, remote.region_token)
        with self._lock:
            mapping = self._peer_maps.get(cache_key)
        if mapping is None:
            try:
                mapping = PeerMapping(remote.pid, remote.region_fd, remote.region_token,
                                      remote.region_offset + remote.size)
            except RegionUnavailable as exc:
                _log.warning("create_session: %s", exc)
                return None
            with self._lock:
                mapping = self._peer_maps.setdefault(cache_key, mapping)
        if mapping.size < remote.region_offset + remote.size:
            mapping = PeerMapping(remote.pid, remote.region_fd, remote.region_token,
                                  remote.region_offset + remote.size)
            with self._lock:
                self._peer_maps[cache_key] = mapping
        return mapping.tensor[remote.region_offset: remote.region_offset + remote.size]

    def _drop_dead_peer_maps(self) -> None:
        """Forget mappings of regions whose owner died or closed them.

        Sessions still using such a mapping keep it until they are collected.
        """
        with self._lock:
            cached = list(self._peer_maps.items())
        dead = [key for key, m in cached if peer_region_problem(m.pid, m.fd, m.token) is not None]
        if dead:
            with self._lock:
                for key in dead:
                    self._peer_maps.pop(key, None)

    def _remote_gone(self, remote: LoopbackMemoryDesc) -> str | None:
        """Why the remote region can no longer take transfers, or None."""
        if remote.pid == self._desc.pid:
            with _process_lock:
                registered = (remote.engine_key, remote.mem_id) in _process_memory
            return None if registered else f"remote memory {remote.mem_id} was deregistered"
        problem = peer_region_problem(remote.pid, remote.region_fd, remote.region_token)
        if problem is not None:
            with self._lock:
                self._peer_maps.pop((remote.pid, remote.region_token), None)
        return problem

    # -- posting and completing ----------------------------------------------
    def _submit(self, session: LoopbackSession, op: str, batch: CheckedBatch) -> LocalTransferStatus:
        status = LocalTransferStatus()
        with self._lock:
            if self._closed:
                status.settle(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine {self.key!r} is closed")
                return status
            self._sequence += 1
            sequence = self._sequence
        posted = PostedTransfer(sequence, op, batch.transfer_uid, session.remote_engine_key,
                                len(batch.sizes), batch.total_bytes)
        verdict = self.faults.decide(posted)
        job = _Job(time.monotonic() + verdict.delay_s, sequence, status, session, op, batch, verdict.failure)
        status.mark_in_progress()
        with self._wake:
            if self._closed:
                status.settle(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine {self.key!r} is closed")
            elif verdict.stall:
                self._stalled.append(job)
            elif verdict.hold is not None and verdict.hold.keep(functools.partial(self._resume_held, job)):
                # Registered before the lock is let go, so a release cannot resume it first.
                self._held[sequence] = job
            else:
                heapq.heappush(self._queue, job)
                self._wake.notify()
        return status

    def _resume_held(self, job: _Job) -> None:
        """Queue a transfer its ``HeldTransfers`` released (close may have failed it)."""
        with self._wake:
            if self._held.pop(job.sequence, None) is None:
                return
            heapq.heappush(self._queue, job)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    if self._closed:
                        return
                    if self._queue:
                        wait_s = self._queue[0].due - time.monotonic()
                        if wait_s <= 0:
                            job = heapq.heappop(self._queue)
                            break
                        self._wake.wait(wait_s)
                    else:
                        self._wake.wait()
            status = job.status
            code, message = self._outcome(job)
            # Let go of the job (its session and their mappings) before anyone
            # woken by the status can look for them.
            del job
            status.settle(code, message)
            del status

    def _outcome(self, job: _Job) -> tuple[int, str]:
        """Carry out one transfer; (final code, message) for its status."""
        label = f"batch_{job.op} uid {job.batch.transfer_uid}"
        try:
            if job.failure is not None:
                return job.failure.code, f"{label}: {job.failure.message}"
            reason = job.session._why_dead()
            if reason is not None:
                return StatusCode.ERR_RDMA_OP, f"{label}: {reason}"
            job.session._execute(job)
            return StatusCode.SUCCESS, ""
        except Exception as exc:  # never let one transfer kill the worker thread
            _log.exception("loopback transfer failed unexpectedly")
            return StatusCode.ERR_BAD_STATE, f"{label}: {exc}"

    def _copy(self, dst: int, src: int, dst_offsets: list[int], src_offsets: list[int],
              sizes: list[int], total_bytes: int) -> None:
        """Copy a batch, splitting a large one across helper threads by bytes."""
        parts = min(self._copy_threads, len(sizes))
        if parts < 2 or total_bytes < self.PARALLEL_COPY_MIN_BYTES:
            _copy_ranges(dst, src, dst_offsets, src_offsets, sizes)
            return
        if self._copy_helpers is None:
            self._copy_helpers = ThreadPoolExecutor(parts - 1, thread_name_prefix=f"loopback-{self.key}-copy")
        bounds = [0]
        share, running = total_bytes / parts, 0
        for index, size in enumerate(sizes):
            running += size
            if running >= share * len(bounds) and len(bounds) < parts:
                bounds.append(index + 1)
        bounds.append(len(sizes))
        slices = [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]
        helpers = [
            self._copy_helpers.submit(_copy_ranges, dst, src, dst_offsets[a:b], src_offsets[a:b], sizes[a:b])
            for a, b in slices[1:]
        ]
        first_a, first_b = slices[0]
        _copy_ranges(dst, src, dst_offsets[first_a:first_b], src_offsets[first_a:first_b], sizes[first_a:first_b])
        for helper in helpers:
            helper.result()

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: engine {self.key!r} is closed")

    def close(self) -> None:
        with self._wake:
            if self._closed:
                return
            self._closed = True
            abandoned = self._queue + self._stalled + list(self._held.values())
            self._queue, self._stalled, self._held = [], [], {}
            self._wake.notify_all()
        for job in abandoned:
            job.status.settle(StatusCode.ERR_BAD_STATE,
                              f"batch_{job.op} uid {job.batch.transfer_uid}: engine "
                              f"{self.key!r} closed before the transfer completed")
        if threading.current_thread() is not self._worker:
            self._worker.join()
        with _process_lock:
            for mem_id in list(self._memory):
                _process_memory.pop((self.key, mem_id), None)
            _process_engine_keys.discard(self.key)
        with self._lock:
            self._memory.clear()
            self._peer_maps.clear()
            regions, self._regions = self._regions, []
        for region in regions:
            region.close()
        if self._copy_helpers is not None:
            self._copy_helpers.shutdown(wait=True)
        # Predicates may capture sessions and tensors; no transfer can use them now.
        self.faults.clear()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<LoopbackEngine {self.key!r} pid={self._desc.pid} {state}>"
