"""LoopbackEngine: a transfer engine that moves real bytes between processes on one host.

It stands in for mori.io where RDMA hardware is absent and keeps mori's rules:
posting returns at once; a worker thread completes statuses INIT -> IN_PROGRESS ->
SUCCESS or an error above 10; bad argument values come back as already-failed
statuses. Writes into a peer's shared region are one-sided: the peer runs no code.
Faults (failures, latency, stalls, holds released on demand, dead sessions or
peers) are injected through ``engine.faults``.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
from itertools import repeat
import logging
import operator
import os
import random
import socket
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch

from .engine import (
    ArgumentProblem,
    TransferEngine,
    CheckedBatch,
    TransferSession,
    check_transfer_batch,
    require_bytes,
)
from .shared_memory import PeerMapping, RegionUnavailable, SharedRegion, peer_region_problem
from .status import LocalTransferStatus, StatusCode, failed_status

__all__ = [
    "LoopbackEngine",
    "LoopbackSession",
    "LoopbackEngineDesc",
    "LoopbackMemoryDesc",
    "LoopbackFaults",
    "HeldTransfers",
    "PostedTransfer",
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


@dataclass(frozen=True, slots=True)
class PostedTransfer:
    """What fault predicates see about one posted batch."""

    sequence: int            # 1-based count of batches posted on this engine
    op: str                  # "write" or "read"
    transfer_uid: int
    remote_engine_key: str
    count: int               # ranges in the batch
    total_bytes: int


class HeldTransfers:
    """Transfers that ``hold_nth`` / ``hold_when`` keep IN_PROGRESS until ``release``.

    A held transfer has been posted and does nothing else: it moves no bytes and
    its status stays IN_PROGRESS, for as long as the test needs, without any
    timing. ``release`` lets every held transfer complete as it would have
    (checks, copy, injected failure) and stops holding later matches. Closing the
    engine fails held transfers with ERR_BAD_STATE, as it does queued ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = False
        self._jobs: list[tuple["_Job", Callable[["_Job"], None]]] = []

    @property
    def held(self) -> int:
        """How many transfers are held right now."""
        with self._lock:
            return len(self._jobs)

    @property
    def released(self) -> bool:
        with self._lock:
            return self._released

    def release(self) -> int:
        """Let the held transfers complete; returns how many were held. Idempotent."""
        with self._lock:
            self._released = True
            jobs, self._jobs = self._jobs, []
        for job, resume in jobs:
            resume(job)
        return len(jobs)

    def _take(self, job: "_Job", resume: Callable[["_Job"], None]) -> bool:
        """Hold ``job`` until release; False if already released (run it now)."""
        with self._lock:
            if self._released:
                return False
            self._jobs.append((job, resume))
            return True

    def __repr__(self) -> str:
        state = "released" if self.released else f"holding {self.held}"
        return f"<HeldTransfers {state}>"


@dataclass(slots=True, eq=False)
class _Rule:
    matches: Callable[[PostedTransfer], bool]
    code: int
    message: str
    once: bool
    hold: HeldTransfers | None = None


class LoopbackFaults:
    """Faults to inject into one engine's transfers; every method is thread-safe.

    Failure rules are checked in the order added; the first that matches decides
    the transfer's error (a failed transfer moves no bytes). A stalled transfer
    stays IN_PROGRESS until the engine closes; a held one until its
    ``HeldTransfers`` is released. Predicates run on the posting thread outside
    every lock, so they may call back into the engine and into this object; an
    exception they raise propagates out of the ``batch_*`` call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: list[_Rule] = []
        self._stalls: list[_Rule] = []
        self._holds: list[_Rule] = []
        self._latency_s = 0.0
        self._jitter_s = 0.0
        self._random = random.Random(0)
        # Weak, so a killed session leaves no trace once collected and a later
        # session that happens to reuse its address is not taken for dead.
        self._dead_sessions: weakref.WeakSet[LoopbackSession] = weakref.WeakSet()
        self._dead_peers: set[str] = set()

    def fail_nth(self, n: int, code: int = StatusCode.ERR_RDMA_OP, message: str = "") -> None:
        """Fail the ``n``-th batch posted on this engine (1-based)."""
        n = _positive("n", n)
        self._add(self._failures, lambda t: t.sequence == n, code,
                  message or f"injected RDMA failure of transfer #{n}", once=True)

    def fail_when(self, predicate: Callable[[PostedTransfer], bool],
                  code: int = StatusCode.ERR_RDMA_OP, message: str = "") -> None:
        """Fail every posted batch for which ``predicate`` returns True."""
        if not callable(predicate):
            raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
        self._add(self._failures, predicate, code, message or "injected RDMA failure", once=False)

    def stall_nth(self, n: int) -> None:
        """Leave the ``n``-th posted batch in progress forever (until close)."""
        n = _positive("n", n)
        self._add(self._stalls, lambda t: t.sequence == n, StatusCode.IN_PROGRESS, "", once=True)

    def stall_when(self, predicate: Callable[[PostedTransfer], bool]) -> None:
        if not callable(predicate):
            raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
        self._add(self._stalls, predicate, StatusCode.IN_PROGRESS, "", once=False)

    def hold_nth(self, n: int) -> HeldTransfers:
        """Hold the ``n``-th batch posted on this engine (1-based) IN_PROGRESS until released."""
        n = _positive("n", n)
        return self._add_hold(lambda t: t.sequence == n, once=True)

    def hold_when(self, predicate: Callable[[PostedTransfer], bool]) -> HeldTransfers:
        """Hold every posted batch for which ``predicate`` returns True, until released."""
        if not callable(predicate):
            raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
        return self._add_hold(predicate, once=False)

    def set_latency(self, latency_s: float, jitter_s: float = 0.0, seed: int | None = 0) -> None:
        """Delay each completion by ``latency_s`` plus uniform [0, ``jitter_s``) seconds."""
        if latency_s < 0 or jitter_s < 0:
            raise ValueError(
                f"latency_s and jitter_s must be >= 0 seconds, got {latency_s} and {jitter_s}"
            )
        with self._lock:
            self._latency_s = float(latency_s)
            self._jitter_s = float(jitter_s)
            self._random = random.Random(seed)

    def kill_session(self, session: "LoopbackSession") -> None:
        """Break one session: its queued and future transfers fail with ERR_RDMA_OP."""
        with self._lock:
            self._dead_sessions.add(session)

    def kill_peer(self, engine_key: str) -> None:
        """Make a remote engine unreachable: every session to it fails with ERR_RDMA_OP."""
        with self._lock:
            self._dead_peers.add(engine_key)

    def clear(self) -> None:
        """Remove every rule, latency and killed session or peer.

        Transfers already held stay held until their ``HeldTransfers`` is released.
        """
        with self._lock:
            self._failures.clear()
            self._stalls.clear()
            self._holds.clear()
            self._latency_s = self._jitter_s = 0.0
            self._dead_sessions.clear()
            self._dead_peers.clear()

    # -- engine side ----------------------------------------------------------
    def _add(self, rules: list[_Rule], matches, code: int, message: str, once: bool) -> None:
        code = int(code)
        if rules is self._failures and code <= 10:
            raise ValueError(f"an injected failure needs an error code above 10, got {code}")
        with self._lock:
            rules.append(_Rule(matches, code, message, once))

    def _add_hold(self, matches, once: bool) -> HeldTransfers:
        hold = HeldTransfers()
        with self._lock:
            self._holds.append(_Rule(matches, StatusCode.IN_PROGRESS, "", once, hold))
        return hold

    def _first_match(self, rules: list[_Rule], posted: PostedTransfer) -> _Rule | None:
        """The first rule matching ``posted``; a one-shot rule is used up by it.

        Predicates are called outside the lock, on a snapshot of the rules.
        """
        if not rules:
            return None
        with self._lock:
            candidates = list(rules)
        for rule in candidates:
            if rule.hold is not None and rule.hold.released:
                with self._lock:
                    if rule in rules:
                        rules.remove(rule)
                continue
            if not rule.matches(posted):
                continue
            if rule.once:
                with self._lock:
                    if rule not in rules:
                        continue  # another thread's post used it up meanwhile
                    rules.remove(rule)
            return rule
        return None

    def _decide(self, posted: PostedTransfer) -> tuple[_Rule | None, bool, HeldTransfers | None, float]:
        """(failure rule or None, stall?, hold or None, completion delay in seconds)."""
        failure = self._first_match(self._failures, posted)
        stall = failure is None and self._first_match(self._stalls, posted) is not None
        hold = None
        if not stall:
            held_by = self._first_match(self._holds, posted)
            hold = held_by.hold if held_by is not None else None
        with self._lock:
            delay = self._latency_s
            if self._jitter_s:
                delay += self._random.uniform(0.0, self._jitter_s)
        return failure, stall, hold, delay

    def _session_dead(self, session: "LoopbackSession") -> str | None:
        with self._lock:
            if session in self._dead_sessions:
                return "session was killed"
            if session.remote_engine_key in self._dead_peers:
                return f"peer engine {session.remote_engine_key!r} is unreachable"
        return None


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (1-based), got {value!r}")
    return value


@dataclass(order=True, slots=True)
class _Job:
    due: float
    sequence: int
    status: LocalTransferStatus = field(compare=False)
    session: "LoopbackSession" = field(compare=False)
    op: str = field(compare=False)
    plan: CheckedBatch = field(compare=False)
    failure: _Rule | None = field(compare=False)


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
        reason = self._engine.faults._session_dead(self)
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
        plan = job.plan
        if job.op == "write":
            src, dst = self._local_address, self._remote_address
            src_offsets, dst_offsets = plan.local_offsets, plan.remote_offsets
        else:
            src, dst = self._remote_address, self._local_address
            src_offsets, dst_offsets = plan.remote_offsets, plan.local_offsets
        self._engine._copy(dst, src, dst_offsets, src_offsets, plan.sizes, plan.total_bytes)


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
    def _submit(self, session: LoopbackSession, op: str, plan: CheckedBatch) -> LocalTransferStatus:
        status = LocalTransferStatus()
        with self._lock:
            if self._closed:
                status.settle(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine {self.key!r} is closed")
                return status
            self._sequence += 1
            sequence = self._sequence
        posted = PostedTransfer(sequence, op, plan.transfer_uid, session.remote_engine_key,
                                len(plan.sizes), plan.total_bytes)
        failure, stall, hold, delay = self.faults._decide(posted)
        job = _Job(time.monotonic() + delay, sequence, status, session, op, plan, failure)
        status.mark_in_progress()
        with self._wake:
            if self._closed:
                status.settle(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine {self.key!r} is closed")
            elif stall:
                self._stalled.append(job)
            elif hold is not None and hold._take(job, self._resume_held):
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
        label = f"batch_{job.op} uid {job.plan.transfer_uid}"
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
                              f"batch_{job.op} uid {job.plan.transfer_uid}: engine "
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
