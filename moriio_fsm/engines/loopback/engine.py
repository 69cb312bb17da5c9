"""LoopbackEngine: mori.io's stand-in, moving real bytes in one process or one-sidedly into a peer's shared memory.

Rules: mori's status semantics (posting returns at once, a worker thread settles each status, bad values give
failed statuses); faults come from ``engine.faults`` (``faults.py``), asked only through its public methods.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
import socket
import threading
from collections import deque
from itertools import count, repeat

import torch

from ..base import EngineBase, SessionBase
from ..checks import CheckedBatch, check_registrable
from ..copy_split import CopyHelpers
from ..faults import LoopbackFaults, PostedTransfer
from ..inflight import Posted, PostQueue, serve
from ..shared_memory import PeerMapping, RegionUnavailable, SharedRegion, peer_region_problem
from ..status import LocalTransferStatus, StatusCode
from .descriptors import NOT_SHARED, LoopbackEngineDesc, LoopbackMemoryDesc

__all__ = ["LoopbackEngine", "LoopbackSession"]

_log = logging.getLogger(__name__)

# Registered memory of every live LoopbackEngine in this process, so that an
# engine can reach a peer engine's memory in the same process without sharing.
_process_memory: dict[tuple[str, int], torch.Tensor] = {}
_process_engine_keys: set[str] = set()
_process_lock = threading.Lock()

_memmove = ctypes.memmove  # a foreign call: it runs without holding the GIL


class LoopbackSession(SessionBase):
    """A channel from a local region to a remote region, in this process or a peer's."""

    killable = True

    def __init__(
        self,
        engine: LoopbackEngine,
        local: LoopbackMemoryDesc,
        remote: LoopbackMemoryDesc,
        local_bytes: torch.Tensor,
        remote_bytes: torch.Tensor,
    ) -> None:
        super().__init__(engine, local, remote)
        # Holding the byte views keeps both mappings alive while jobs use raw addresses.
        self._local_bytes = local_bytes
        self._remote_bytes = remote_bytes
        self._local_address = local_bytes.data_ptr()
        self._remote_address = remote_bytes.data_ptr()

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

    def _execute(self, posted: Posted) -> None:
        batch = posted.batch
        if posted.op == "write":
            src, dst = self._local_address, self._remote_address
            src_offsets, dst_offsets = batch.local_offsets, batch.remote_offsets
        else:
            src, dst = self._remote_address, self._local_address
            src_offsets, dst_offsets = batch.remote_offsets, batch.local_offsets
        self._engine._copy(dst, src, dst_offsets, src_offsets, batch.sizes, batch.total_bytes)


def _copy_ranges(
    dst: int, src: int, dst_offsets: list[int], src_offsets: list[int], sizes: list[int]
) -> None:
    """Copy each range; ranges adjacent on both sides go as one larger copy.

    The per-range work runs inside ``map`` (C loops), because with 64 KiB ranges
    Python bytecode per range would cost a noticeable share of the copy itself.
    """
    dst_ends = list(map(operator.add, dst_offsets, sizes))
    src_ends = list(map(operator.add, src_offsets, sizes))
    follows_on = list(
        map(
            operator.and_,
            map(operator.eq, dst_offsets[1:], dst_ends),
            map(operator.eq, src_offsets[1:], src_ends),
        )
    )
    if any(follows_on):
        starts = [0] + [i + 1 for i, joined in enumerate(follows_on) if not joined]
        last = [i - 1 for i in starts[1:]] + [len(sizes) - 1]
        dst_offsets = [dst_offsets[i] for i in starts]
        src_offsets = [src_offsets[i] for i in starts]
        sizes = [dst_ends[j] - dst_offsets[k] for k, j in enumerate(last)]
    deque(
        map(
            _memmove,
            map(operator.add, repeat(dst), dst_offsets),
            map(operator.add, repeat(src), src_offsets),
            sizes,
        ),
        maxlen=0,
    )


class LoopbackEngine(EngineBase[LoopbackEngineDesc, LoopbackMemoryDesc]):
    """A transfer engine whose "network" is shared memory on one host.

    Memory from ``allocate_shared_tensor`` can be reached by engines in other
    processes; any other CPU tensor only by engines in this process. Engine keys
    must be unique among live engines of a process. ``close`` fails every
    transfer still queued, stalled or held with ERR_BAD_STATE, stops the worker thread,
    drops every fault rule and releases shared regions this engine allocated.
    """

    engine_desc_type = LoopbackEngineDesc
    memory_desc_type = LoopbackMemoryDesc

    # Below this many bytes a batch is copied by the worker alone: handing work
    # to a helper thread costs more than it saves.
    PARALLEL_COPY_MIN_BYTES = 8 << 20

    def __init__(
        self, key: str, host: str = "", port: int = 0, *, copy_threads: int | None = None
    ) -> None:
        if copy_threads is None:
            copy_threads = min(2, os.cpu_count() or 1)
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or copy_threads < 1:
            raise ValueError(f"copy_threads must be a positive integer, got {copy_threads!r}")
        super().__init__(key)
        with _process_lock:
            if key in _process_engine_keys:
                raise ValueError(
                    f"a LoopbackEngine with key {key!r} is already live in this process"
                )
            _process_engine_keys.add(key)
        self.faults: LoopbackFaults = LoopbackFaults()
        self._desc = LoopbackEngineDesc(key, os.getpid(), socket.gethostname(), host, int(port))
        self._lock = threading.Lock()
        self._mem_ids = count(1)
        self._queue: PostQueue[Posted] = PostQueue()
        self._regions: list[SharedRegion] = []
        self._memory: dict[int, tuple[LoopbackMemoryDesc, torch.Tensor]] = {}
        self._remote_engines: dict[str, LoopbackEngineDesc] = {}
        self._peer_maps: dict[tuple[int, str], PeerMapping] = {}
        self._helpers = CopyHelpers(copy_threads, f"loopback-{key}")
        self._worker = threading.Thread(
            target=serve, args=(self._queue, self._outcomes), name=f"loopback-{key}", daemon=True
        )
        self._worker.start()

    # -- descriptors and registration ------------------------------------------
    def register_remote_engine(self, desc: LoopbackEngineDesc) -> None:
        self._check_engine_desc(desc)
        with self._lock:
            self._remote_engines[desc.key] = desc

    def deregister_remote_engine(self, desc: LoopbackEngineDesc) -> None:
        self._check_engine_desc(desc)
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
        nbytes = check_registrable(tensor, "LoopbackEngine")
        self._require_open("register_torch_tensor")
        address = tensor.data_ptr()
        flat = tensor.reshape(-1).view(torch.uint8)
        region = next(
            (r for r in self._regions if not r.closed and r.contains(address, nbytes)), None
        )
        with self._lock:
            mem_id = next(self._mem_ids)
            desc = LoopbackMemoryDesc(
                engine_key=self.key,
                mem_id=mem_id,
                size=nbytes,
                pid=self._desc.pid,
                region_fd=region.fd if region else NOT_SHARED,
                region_token=region.token if region else "",
                region_offset=address - region.base_address if region else 0,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(tensor.shape),
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
        self._check_memory_desc(mem)
        with self._lock:
            self._memory.pop(mem.mem_id, None)
        with _process_lock:
            _process_memory.pop((self.key, mem.mem_id), None)
        with self._lock:
            self._regions = [r for r in self._regions if not r.closed]

    # -- sessions ------------------------------------------------------------
    def create_session(self, local_mem, remote_mem) -> LoopbackSession | None:
        """A session, or None when a region or the remote engine cannot be reached."""
        self._check_session_descs(local_mem, remote_mem)
        if self._closed:
            return None
        with self._lock:
            local = self._memory.get(local_mem.mem_id) if local_mem.engine_key == self.key else None
            remote_engine = self._remote_engines.get(remote_mem.engine_key)
        if local is None:
            _log.warning(
                "create_session: local memory %s is not registered with engine %r",
                local_mem.mem_id,
                self.key,
            )
            return None
        if remote_mem.engine_key != self.key and (
            remote_engine is None or remote_engine.pid != remote_mem.pid
        ):
            _log.warning(
                "create_session: remote engine %r is not registered", remote_mem.engine_key
            )
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
                _log.warning(
                    "create_session: memory %s of engine %r is not registered",
                    remote.mem_id,
                    remote.engine_key,
                )
                return None
            return found
        if not remote.shared:
            _log.warning(
                "create_session: memory %s of engine %r is not shared memory; only "
                "tensors from allocate_shared_tensor can be reached across processes",
                remote.mem_id,
                remote.engine_key,
            )
            return None
        self._drop_dead_peer_maps()
        cache_key = (remote.pid, remote.region_token)
        with self._lock:
            mapping = self._peer_maps.get(cache_key)
        if mapping is None:
            try:
                mapping = PeerMapping(
                    remote.pid,
                    remote.region_fd,
                    remote.region_token,
                    remote.region_offset + remote.size,
                )
            except RegionUnavailable as exc:
                _log.warning("create_session: %s", exc)
                return None
            with self._lock:
                mapping = self._peer_maps.setdefault(cache_key, mapping)
        if mapping.size < remote.region_offset + remote.size:
            mapping = PeerMapping(
                remote.pid,
                remote.region_fd,
                remote.region_token,
                remote.region_offset + remote.size,
            )
            with self._lock:
                self._peer_maps[cache_key] = mapping
        return mapping.tensor[remote.region_offset : remote.region_offset + remote.size]

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
    def _submit(
        self, session: LoopbackSession, op: str, batch: CheckedBatch
    ) -> LocalTransferStatus:
        status = LocalTransferStatus()
        sequence = self._queue.number()
        if sequence is not None:
            verdict = self.faults.decide(
                PostedTransfer(
                    sequence,
                    op,
                    batch.transfer_uid,
                    session.remote_engine_key,
                    len(batch.sizes),
                    batch.total_bytes,
                )
            )
            status.mark_in_progress()
            if self._queue.put(
                Posted(status, session, op, batch, verdict.failure), sequence, verdict
            ):
                return status
        status.settle(StatusCode.ERR_BAD_STATE, f"batch_{op}: engine {self.key!r} is closed")
        return status

    def _outcomes(self, due: list[Posted]) -> list[tuple[int, str, None]]:
        return [self._outcome(posted) for posted in due]

    def _outcome(self, posted: Posted) -> tuple[int, str, None]:
        """Carry out one transfer; (final code, message, None) for its status."""
        try:
            if posted.failure is not None:
                return posted.failure.code, posted.failure.message, None
            reason = posted.session._why_dead()
            if reason is not None:
                return StatusCode.ERR_RDMA_OP, reason, None
            posted.session._execute(posted)
            return StatusCode.SUCCESS, "", None
        except Exception as exc:  # never let one transfer kill the worker thread
            _log.exception("loopback transfer failed unexpectedly")
            return StatusCode.ERR_BAD_STATE, str(exc), None

    def _copy(
        self,
        dst: int,
        src: int,
        dst_offsets: list[int],
        src_offsets: list[int],
        sizes: list[int],
        total_bytes: int,
    ) -> None:
        """Copy a batch, splitting a large one across helper threads by bytes."""
        self._helpers.run(
            lambda a, b: _copy_ranges(dst, src, dst_offsets[a:b], src_offsets[a:b], sizes[a:b]),
            sizes,
            total_bytes,
            self.PARALLEL_COPY_MIN_BYTES,
        )

    def close(self) -> None:
        self._closed = True
        abandoned = self._queue.close()
        if abandoned is None:
            return
        for posted in abandoned:
            posted.fail_closed(self.key)
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
        self._helpers.shutdown()
        # Predicates may capture sessions and tensors; no transfer can use them now.
        self.faults.clear()
