"""NixlEngine: the project's transfer-engine interface over NIXL (UCX inside: TCP, shared memory, RDMA where present).

Rules: mori's status semantics (posting returns at once, bad values come back as already-failed statuses, first
final code wins); one thread per engine owns every NIXL call that moves bytes and progresses UCX, with sleeps
between polls instead of NIXL's spinning progress thread; memory in use by a transfer is never deregistered natively.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from ..interface import ArgumentProblem, CheckedBatch, TransferEngine, TransferSession, check_transfer_batch, \
    require_bytes
from ..status import LocalTransferStatus, StatusCode, failed_status
from .availability import NixlUnavailableError, nixl_api
from .ucx_env import ucx_environment

__all__ = ["NixlEngine", "NixlEngineDesc", "NixlMemoryDesc", "NixlSession"]

_log = logging.getLogger(__name__)

_Positive = Annotated[int, msgspec.Meta(gt=0)]

# What a transfer that NIXL or UCX could not stop still holds (its handle, its agent, its
# tensors): kept for the life of the process so that bytes still moving land in memory
# nobody reuses. A leak, never a corruption.
_lingering: list[Any] = []


class NixlEngineDesc(msgspec.Struct, frozen=True, tag="moriio-nixl-engine"):
    """Who a NIXL engine is: its agent name (the engine key) and the agent's packed metadata."""

    key: str
    agent_metadata: bytes  # NIXL's full local metadata: connection info and the memory registered so far
    host: str = ""
    hostname: str = ""
    pid: int = 0

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def unpack(cls, packed: Any) -> "NixlEngineDesc":
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for bytes that are not such a descriptor."""
        return _decode("engine descriptor", cls, packed)


class NixlMemoryDesc(msgspec.Struct, frozen=True, tag="moriio-nixl-memory"):
    """One registered tensor: its owner, where it lives, how big it is, and NIXL's metadata for it alone."""

    engine_key: str
    mem_id: _Positive
    address: _Positive
    size: _Positive
    dtype: str
    shape: tuple[int, ...]
    # Partial agent metadata of this one region (no connection info): a peer that learned the
    # engine before this tensor was registered loads it from here.
    metadata: bytes = b""

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def unpack(cls, packed: Any) -> "NixlMemoryDesc":
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for bytes that are not such a descriptor."""
        return _decode("memory descriptor", cls, packed)


def _decode(what: str, kind: type, packed: Any):
    data = require_bytes(what, packed)
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"{what} is not a packed {kind.__name__}: {exc}") from None


@dataclass(eq=False)
class _Peer:
    desc: NixlEngineDesc
    generation: int
    loaded: set[int] = field(default_factory=set)  # mem_ids of its memory loaded into our agent
    withdrawn: bool = False
    broken: str | None = None  # why the transport to it failed; later transfers fail at once

    def gone(self) -> str | None:
        if self.withdrawn:
            return f"remote engine {self.desc.key!r} was deregistered"
        return self.broken


@dataclass(frozen=True, slots=True)
class _Registration:
    desc: NixlMemoryDesc
    tensor: torch.Tensor  # held so the memory cannot be freed while NIXL may reach it
    reg_descs: Any  # NIXL's registration list, what deregistration takes


@dataclass(slots=True, eq=False)
class _Posted:
    status: LocalTransferStatus
    session: "NixlSession"
    op: str
    batch: CheckedBatch
    handle: Any = None
    deadline: float = 0.0
    cancel_failed: bool = False

    @property
    def label(self) -> str:
        return f"batch_{self.op} uid {self.batch.transfer_uid}"


class NixlSession(TransferSession):
    """A channel from one local registered tensor to one registered tensor of a peer (or this) engine."""

    def __init__(self, engine: "NixlEngine", local: NixlMemoryDesc, remote: NixlMemoryDesc,
                 peer: _Peer | None) -> None:
        self._engine = engine
        self.local_mem = local
        self.remote_mem = remote
        self.remote_engine_key = remote.engine_key
        self._peer = peer  # None: the remote memory is this engine's own

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("write", local_offsets, remote_offsets, sizes, transfer_uid)

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("read", local_offsets, remote_offsets, sizes, transfer_uid)

    def alive(self) -> bool:
        return self.why_dead() is None

    def why_dead(self) -> str | None:
        """Why transfers on this session fail now, or None."""
        engine = self._engine
        if engine.closed:
            return f"engine {engine.key!r} is closed"
        if not engine._holds(self.local_mem):
            return f"local memory {self.local_mem.mem_id} was deregistered"
        if self._peer is None:
            return None if engine._holds(self.remote_mem) else \
                f"memory {self.remote_mem.mem_id} of this engine was deregistered"
        return self._peer.gone() or engine._peer_replaced(self._peer)

    def _post(self, op, local_offsets, remote_offsets, sizes, transfer_uid):
        checked = check_transfer_batch(
            local_offsets, remote_offsets, sizes, transfer_uid,
            local_size=self.local_mem.size, remote_size=self.remote_mem.size,
        )
        if isinstance(checked, ArgumentProblem):
            return failed_status(checked.code, f"batch_{op}: {checked.message}")
        return self._engine._submit(self, op, checked)


class NixlEngine(TransferEngine):
    """A transfer engine over a NIXL agent with the UCX backend; peers on this host or others.

    Any contiguous CPU tensor can be registered (as NIXL DRAM), wherever the process
    allocated it. A peer learns this engine from ``get_engine_desc().pack()`` (NIXL's agent
    metadata) and each tensor from its memory descriptor, which carries that tensor's own
    metadata, so the order of handshake and registration does not matter.

    UCX moves bytes one-sidedly, but over TCP the target's UCX worker must be progressed to
    receive them: the engine's thread does so every ``idle_progress_s`` while it has
    nothing of its own in flight, and polls its own transfers with a backoff from
    ``min_poll_s`` up to ``idle_progress_s``. It sleeps in between, so the engine costs a few
    percent of a core, not a whole one (NIXL's own progress thread spins). Over shared
    memory (``sm``: cross-memory attach) the initiator moves the bytes itself.

    A transfer not final after ``transfer_timeout_s`` is cancelled and fails; one that NIXL
    cannot cancel stays in progress until it ends. Deregistering memory, or closing, waits
    up to ``deregister_wait_s`` for this engine's transfers on it; memory still in use after
    that stays registered and allocated. NIXL cannot tell this engine that a peer still
    writes into its memory: deregister only memory that peers stopped using (the
    machines hand blocks back only then).

    ``port`` is kept for the interface the engines share; UCX picks its own ports. The UCX
    environment comes from ``ucx_environment`` (``ucx`` overrides, then the
    process environment, then defaults: TCP, shared memory and self on the interface of
    ``host``), applied to ``os.environ`` before the agent starts.
    """

    def __init__(self, key: str, host: str = "127.0.0.1", port: int = 0, *,
                 ucx: dict[str, str] | None = None, transfer_timeout_s: float = 120.0,
                 idle_progress_s: float = 0.001, min_poll_s: float = 0.00002,
                 deregister_wait_s: float = 10.0) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"engine key must be a non-empty string, got {key!r}")
        if not isinstance(host, str):
            raise TypeError(f"host must be a string, got {type(host).__name__}")
        for name, value in (("transfer_timeout_s", transfer_timeout_s), ("idle_progress_s", idle_progress_s),
                            ("min_poll_s", min_poll_s), ("deregister_wait_s", deregister_wait_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if not idle_progress_s > 0 or not transfer_timeout_s > 0:
            raise ValueError("idle_progress_s and transfer_timeout_s must be > 0 seconds, got "
                             f"{idle_progress_s!r} and {transfer_timeout_s!r}")
        api = nixl_api()
        self.key = key
        self.ucx_applied = ucx_environment(host, ucx)
        self._api = api
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self._agent = api.nixl_agent(key, config)
        if "UCX" not in self._agent.get_plugin_list():
            raise NixlUnavailableError(f"nixl has no UCX plugin here (plugins: {self._agent.get_plugin_list()})")
        try:
            self._agent.create_backend("UCX", {})
        except Exception as exc:
            settings = ", ".join(f"{name}={os.environ[name]}" for name in sorted(os.environ)
                                 if name.startswith("UCX_"))
            raise NixlUnavailableError(f"NIXL's UCX backend did not start for engine {key!r} ({settings}): "
                                       f"{type(exc).__name__}: {exc}") from None
        self._desc = NixlEngineDesc(key=key, agent_metadata=self._agent.get_agent_metadata(), host=host,
                                    hostname=socket.gethostname(), pid=os.getpid())
        self._host = host
        self._port = int(port)
        self._transfer_timeout_s = float(transfer_timeout_s)
        self._idle_progress_s = float(idle_progress_s)
        self._min_poll_s = float(min_poll_s)
        self._deregister_wait_s = float(deregister_wait_s)
        # NIXL agents are made without thread synchronisation: every call takes this lock.
        self._agent_lock = threading.Lock()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._uids = itertools.count(1)
        self._mem_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._memory: dict[int, _Registration] = {}
        self._peers: dict[str, _Peer] = {}
        self._busy: Counter = Counter()  # ("mem", id) / ("peer", generation) -> transfers using it
        self._incoming: list[_Posted] = []
        self._stuck = False  # a transfer NIXL could not cancel at close: nothing may be freed
        self._worker = threading.Thread(target=self._run, name=f"nixl-{key}", daemon=True)
        self._worker.start()

    # -- descriptors and registration ------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def get_engine_desc(self) -> NixlEngineDesc:
        return self._desc

    def unpack_engine_desc(self, packed: bytes) -> NixlEngineDesc:
        return NixlEngineDesc.unpack(packed)

    def unpack_memory_desc(self, packed: bytes) -> NixlMemoryDesc:
        return NixlMemoryDesc.unpack(packed)

    def register_remote_engine(self, desc: NixlEngineDesc) -> None:
        """Load a peer's agent metadata; raises ``ValueError`` when NIXL refuses it or it names another agent.

        Registering the same descriptor again is a no-op; a new descriptor under a known
        key (the peer restarted) replaces the old one, whose sessions then fail.
        """
        if not isinstance(desc, NixlEngineDesc):
            raise TypeError(f"desc must be a NixlEngineDesc, got {type(desc).__name__}")
        self._require_open("register_remote_engine")
        if desc.key == self.key:
            if desc.agent_metadata != self._desc.agent_metadata:
                raise ValueError(f"engine key {desc.key!r} is this engine's own, but the descriptor is another's")
            return
        with self._lock:
            known = self._peers.get(desc.key)
        if known is not None and known.desc == desc and known.gone() is None:
            return
        if known is not None:
            self._withdraw(known)
        with self._agent_lock:
            try:
                name = self._agent.add_remote_agent(desc.agent_metadata)
            except Exception as exc:
                raise ValueError(f"NIXL refused the metadata of engine {desc.key!r}: "
                                 f"{type(exc).__name__}: {exc}") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != desc.key:
                self._forget_agent(name)
                raise ValueError(f"the metadata of engine {desc.key!r} names NIXL agent {name!r}")
        with self._lock:
            self._peers[desc.key] = _Peer(desc, next(self._generations))

    def deregister_remote_engine(self, desc: NixlEngineDesc) -> None:
        """Forget a peer: its sessions' later transfers fail; NIXL drops it once none is in flight."""
        if not isinstance(desc, NixlEngineDesc):
            raise TypeError(f"desc must be a NixlEngineDesc, got {type(desc).__name__}")
        with self._lock:
            peer = self._peers.get(desc.key)
        if peer is not None:
            self._withdraw(peer)

    def _withdraw(self, peer: _Peer) -> None:
        with self._wake:
            peer.withdrawn = True
            if self._peers.get(peer.desc.key) is peer:
                del self._peers[peer.desc.key]
            quiet = self._wait_idle(("peer", peer.generation))
        if quiet:
            with self._agent_lock:
                self._forget_agent(peer.desc.key)
        else:
            _log.warning("remote engine %r: transfers still in flight after %.1f s; NIXL keeps it loaded",
                         peer.desc.key, self._deregister_wait_s)

    def _forget_agent(self, name: str) -> None:
        """Drop a remote agent from NIXL (agent lock held); NIXL errors are logged, not raised."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            _log.warning("NIXL could not drop remote agent %r: %s", name, exc)

    def _wait_idle(self, what: tuple) -> bool:
        """Wait (``_wake`` held) until no transfer uses ``what``, up to ``deregister_wait_s``."""
        deadline = time.monotonic() + self._deregister_wait_s
        while self._busy[what] > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._wake.wait(left)
        self._busy.pop(what, None)
        return True

    def register_torch_tensor(self, tensor: torch.Tensor) -> NixlMemoryDesc:
        """Register a contiguous, non-empty CPU tensor as NIXL DRAM.

        Raises ``TypeError`` for a non-tensor and ``ValueError`` for a tensor that is not
        contiguous, not on the CPU or empty, or that NIXL refuses.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"NixlEngine registers host memory (DRAM) only; the tensor is on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} with strides {tuple(tensor.stride())} "
                             "must be contiguous to be registered (register a contiguous byte view of it)")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("an empty tensor cannot be registered")
        self._require_open("register_torch_tensor")
        address = tensor.data_ptr()
        with self._agent_lock:
            try:
                reg_descs = self._agent.register_memory([(address, nbytes, 0, "")], "DRAM")
                metadata = self._agent.get_partial_agent_metadata(reg_descs, False)
            except Exception as exc:
                raise ValueError(f"NIXL refused to register {nbytes} bytes at {address:#x}: "
                                 f"{type(exc).__name__}: {exc}") from None
        with self._lock:
            mem_id = next(self._mem_ids)
            desc = NixlMemoryDesc(engine_key=self.key, mem_id=mem_id, address=address, size=nbytes,
                                  dtype=str(tensor.dtype).removeprefix("torch."), shape=tuple(tensor.shape),
                                  metadata=metadata)
            self._memory[mem_id] = _Registration(desc, tensor, reg_descs)
        return desc

    def deregister_memory(self, mem: NixlMemoryDesc) -> None:
        """Stop this engine's transfers on ``mem``: later ones fail; waits for those in flight.

        Unknown (already deregistered) memory is ignored.
        """
        if not isinstance(mem, NixlMemoryDesc):
            raise TypeError(f"mem must be a NixlMemoryDesc, got {type(mem).__name__}")
        if mem.engine_key != self.key:
            raise ValueError(f"memory {mem.mem_id} belongs to engine {mem.engine_key!r}, not {self.key!r}")
        with self._wake:
            registration = self._memory.pop(mem.mem_id, None)
            if registration is None:
                return
            quiet = self._wait_idle(("mem", mem.mem_id))
        if not quiet:
            _log.warning("memory %s of engine %r: a transfer was still in flight after %.1f s; it stays "
                         "registered and allocated", mem.mem_id, self.key, self._deregister_wait_s)
            _lingering.append(registration)
            return
        with self._agent_lock:
            self._deregister_natively(registration)

    def _deregister_natively(self, registration: _Registration) -> None:
        try:
            self._agent.deregister_memory(registration.reg_descs)
        except Exception as exc:
            _log.warning("NIXL could not deregister memory %s of engine %r: %s; it stays allocated",
                         registration.desc.mem_id, self.key, exc)
            _lingering.append(registration)

    def _holds(self, mem: NixlMemoryDesc) -> bool:
        registration = self._memory.get(mem.mem_id)
        return registration is not None and registration.desc == mem

    def _peer_replaced(self, peer: _Peer) -> str | None:
        if self._peers.get(peer.desc.key) is not peer:
            return f"remote engine {peer.desc.key!r} was deregistered or registered anew"
        return None

    def allocate_transfer_uid(self) -> int:
        with self._lock:
            return next(self._uids)

    # -- sessions ------------------------------------------------------------
    def create_session(self, local_mem, remote_mem) -> NixlSession | None:
        """A session, or None when a region or the remote engine is not registered or NIXL refuses it (logged)."""
        if not isinstance(local_mem, NixlMemoryDesc) or not isinstance(remote_mem, NixlMemoryDesc):
            raise TypeError(
                f"create_session needs two NixlMemoryDesc, got "
                f"{type(local_mem).__name__} and {type(remote_mem).__name__}")
        if self._closed:
            return None
        if local_mem.engine_key != self.key or not self._holds(local_mem):
            _log.warning("create_session: local memory %s is not registered with engine %r",
                         local_mem.mem_id, self.key)
            return None
        if remote_mem.engine_key == self.key:
            if not self._holds(remote_mem):
                _log.warning("create_session: memory %s of engine %r is not registered", remote_mem.mem_id, self.key)
                return None
            return NixlSession(self, local_mem, remote_mem, None)
        with self._lock:
            peer = self._peers.get(remote_mem.engine_key)
        if peer is None or peer.gone() is not None:
            _log.warning("create_session: remote engine %r is not registered%s", remote_mem.engine_key,
                         f" ({peer.gone()})" if peer is not None else "")
            return None
        if remote_mem.mem_id not in peer.loaded:
            if not remote_mem.metadata:
                _log.warning("create_session: memory %s of engine %r carries no NIXL metadata",
                             remote_mem.mem_id, remote_mem.engine_key)
                return None
            with self._agent_lock:
                try:
                    name = self._agent.add_remote_agent(remote_mem.metadata)
                except Exception as exc:
                    _log.warning("create_session: NIXL refused the metadata of memory %s of engine %r: %s",
                                 remote_mem.mem_id, remote_mem.engine_key, exc)
                    return None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != remote_mem.engine_key:
                _log.warning("create_session: the metadata of memory %s of engine %r names NIXL agent %r",
                             remote_mem.mem_id, remote_mem.engine_key, name)
                return None
            peer.loaded.add(remote_mem.mem_id)
        return NixlSession(self, local_mem, remote_mem, peer)

    # -- posting and completing ----------------------------------------------
    def _submit(self, session: NixlSession, op: str, batch: CheckedBatch) -> LocalTransferStatus:
        """Queue one checked batch for the engine's thread; returns its status at once."""
        status = LocalTransferStatus()
        posted = _Posted(status, session, op, batch)
        with self._wake:
            reason = session.why_dead()
            if reason is not None:
                code = StatusCode.ERR_BAD_STATE if self._closed else StatusCode.ERR_RDMA_OP
                status.settle(code, f"{posted.label}: {reason}")
                return status
            for what in self._uses(posted):
                self._busy[what] += 1
            status.mark_in_progress()
            self._incoming.append(posted)
            self._wake.notify()
        return status

    @staticmethod
    def _uses(posted: _Posted) -> list[tuple]:
        session = posted.session
        uses = [("mem", session.local_mem.mem_id)]
        if session._peer is None:
            uses.append(("mem", session.remote_mem.mem_id))
        else:
            uses.append(("peer", session._peer.generation))
        return uses

    def _finish(self, posted: _Posted, code: int, message: str = "", *, transport_failed: bool = False) -> None:
        """Settle a transfer and let go of what it used (the worker, or close)."""
        peer = posted.session._peer
        if transport_failed and peer is not None and peer.broken is None:
            # UCX does not bring an endpoint in error back: later transfers fail at once,
            # until the peer is registered again.
            peer.broken = f"the transport to engine {peer.desc.key!r} failed ({posted.label}: {message})"
        with self._wake:
            for what in self._uses(posted):
                self._busy[what] -= 1
            self._wake.notify_all()
        posted.status.settle(code, f"{posted.label}: {message}" if message else "")

    def _run(self) -> None:
        active: list[_Posted] = []
        pause = self._min_poll_s
        while True:
            with self._wake:
                if not self._closed and not self._incoming:
                    self._wake.wait(pause if active else self._idle_progress_s)
                if self._closed:
                    break
                incoming, self._incoming = self._incoming, []
            for posted in incoming:
                if self._start(posted):
                    active.append(posted)
            if active:
                before = len(active)
                active = [posted for posted in active if not self._check(posted)]
                pause = self._min_poll_s if incoming or len(active) < before else \
                    min(pause * 2, self._idle_progress_s)
            else:
                self._progress()
        self._abandon(active)

    def _start(self, posted: _Posted) -> bool:
        """Build and post one NIXL transfer request; True while it is in flight."""
        session = posted.session
        reason = session.why_dead()
        if reason is not None:
            self._finish(posted, StatusCode.ERR_RDMA_OP, reason)
            return False
        batch = posted.batch
        count = len(batch.sizes)
        local = np.empty((count, 3), dtype=np.uint64)
        local[:, 0] = np.asarray(batch.local_offsets, dtype=np.uint64) + np.uint64(session.local_mem.address)
        local[:, 1] = batch.sizes
        local[:, 2] = 0
        remote = local.copy()
        remote[:, 0] = np.asarray(batch.remote_offsets, dtype=np.uint64) + np.uint64(session.remote_mem.address)
        peer_name = self.key if session._peer is None else session.remote_engine_key
        with self._agent_lock:
            try:
                local_descs = self._agent.get_xfer_descs(local, "DRAM")
                remote_descs = self._agent.get_xfer_descs(remote, "DRAM")
                posted.handle = self._agent.initialize_xfer(posted.op.upper(), local_descs, remote_descs, peer_name)
            except Exception as exc:
                not_found = "NotFound" in type(exc).__name__
                self._finish(posted, StatusCode.ERR_NOT_FOUND if not_found else StatusCode.ERR_BAD_STATE,
                             f"NIXL refused the transfer request: {type(exc).__name__}: {exc}")
                return False
            try:
                state = self._agent.transfer(posted.handle)
            except Exception as exc:
                state = f"ERR ({type(exc).__name__}: {exc})"
        posted.deadline = time.monotonic() + self._transfer_timeout_s
        return not self._settle_if_final(posted, state)

    def _check(self, posted: _Posted) -> bool:
        """Poll one transfer; True once it is final (settled)."""
        with self._agent_lock:
            try:
                state = self._agent.check_xfer_state(posted.handle)
            except Exception as exc:
                state = f"ERR ({type(exc).__name__}: {exc})"
        if self._settle_if_final(posted, state):
            return True
        if time.monotonic() < posted.deadline:
            return False
        if self._cancel(posted):
            self._finish(posted, StatusCode.ERR_RDMA_OP,
                         f"not complete after {self._transfer_timeout_s:g} s; cancelled")
            return True
        if not posted.cancel_failed:
            posted.cancel_failed = True
            _log.warning("%s of engine %r: NIXL could not cancel it after %g s; it stays in progress",
                         posted.label, self.key, self._transfer_timeout_s)
        posted.deadline = time.monotonic() + 1.0  # try to cancel again later
        return False

    def _settle_if_final(self, posted: _Posted, state: str) -> bool:
        if state == "PROC":
            return False
        if state == "DONE":
            self._release(posted)
            self._finish(posted, StatusCode.SUCCESS)
        else:
            self._release(posted)
            self._finish(posted, StatusCode.ERR_RDMA_OP,
                         f"NIXL reported the transfer failed ({state}): the peer is gone or the transport broke",
                         transport_failed=True)
        return True

    def _release(self, posted: _Posted) -> None:
        with self._agent_lock:
            try:
                self._agent.release_xfer_handle(posted.handle)
            except Exception as exc:
                _log.warning("%s of engine %r: releasing its NIXL handle failed: %s", posted.label, self.key, exc)
                _lingering.append(posted.handle)

    def _cancel(self, posted: _Posted) -> bool:
        """Release an unfinished request (NIXL cancels it); False when NIXL could not."""
        with self._agent_lock:
            try:
                self._agent.release_xfer_handle(posted.handle)
            except Exception:
                return False
        return True

    def _progress(self) -> None:
        """Progress UCX with nothing of our own in flight, so peers' transfers into this engine move."""
        with self._agent_lock:
            try:
                self._agent.get_new_notifs()
            except Exception as exc:  # never let progress end the worker thread
                _log.warning("NIXL progress of engine %r failed: %s", self.key, exc)

    def _abandon(self, active: list[_Posted]) -> None:
        """At close: fail what is queued or in flight; what cannot be cancelled keeps its resources."""
        with self._wake:
            queued, self._incoming = self._incoming, []
        closed_text = f"engine {self.key!r} closed before the transfer completed"
        for posted in queued:
            self._finish(posted, StatusCode.ERR_BAD_STATE, closed_text)
        for posted in active:
            if self._cancel(posted):
                self._finish(posted, StatusCode.ERR_BAD_STATE, closed_text)
            else:
                _lingering.append(posted.handle)
                self._stuck = True
                self._finish(posted, StatusCode.ERR_BAD_STATE, closed_text + " (NIXL could not cancel it)")

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: engine {self.key!r} is closed")

    def close(self) -> None:
        """Fail every transfer still queued or in flight (ERR_BAD_STATE), then release NIXL's resources.

        Idempotent. When NIXL could not cancel a transfer, the agent and every registered
        tensor are kept for the life of the process instead of being freed under it.
        """
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        if threading.current_thread() is not self._worker:
            self._worker.join()
        with self._lock:
            registrations, self._memory = list(self._memory.values()), {}
            peers, self._peers = list(self._peers.values()), {}
        if self._stuck:
            _lingering.extend([self._agent, *registrations])
            return
        with self._agent_lock:
            for registration in registrations:
                self._deregister_natively(registration)
            for peer in peers:
                peer.withdrawn = True
                self._forget_agent(peer.desc.key)
        # The agent's destructor tears UCX down; nothing of ours can reach it any more.
        self._agent = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<NixlEngine {self.key!r} host={self._host} {state}>"
