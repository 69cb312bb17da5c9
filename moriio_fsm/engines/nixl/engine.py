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

import torch

from ..base import EngineBase
from ..checks import CheckedBatch, check_registrable
from ..inflight import PostQueue, closed_text
from ..status import LocalTransferStatus, StatusCode
from .agent import lingering, start_agent
from .availability import nixl_api
from .descriptors import NixlEngineDesc, NixlMemoryDesc
from .session import NixlSession, Peer, Registration, Transfer
from .transfer_loop import TransferLoop
from .ucx_env import ucx_environment

__all__ = ["NixlEngine", "NixlSession"]

_log = logging.getLogger(__name__)


class NixlEngine(EngineBase[NixlEngineDesc, NixlMemoryDesc], TransferLoop):
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

    engine_desc_type = NixlEngineDesc
    memory_desc_type = NixlMemoryDesc

    def __init__(
        self,
        key: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ucx: dict[str, str] | None = None,
        transfer_timeout_s: float = 120.0,
        idle_progress_s: float = 0.001,
        min_poll_s: float = 0.00002,
        deregister_wait_s: float = 10.0,
    ) -> None:
        super().__init__(key)
        _check_settings(
            host,
            transfer_timeout_s=transfer_timeout_s,
            idle_progress_s=idle_progress_s,
            min_poll_s=min_poll_s,
            deregister_wait_s=deregister_wait_s,
        )
        api = nixl_api()
        self.ucx_applied = ucx_environment(host, ucx)
        self._api = api
        self._agent = start_agent(api, key)
        self._desc = self._describe(host)
        self._host = host
        self._port = int(port)
        self._transfer_timeout_s = float(transfer_timeout_s)
        self._idle_progress_s = float(idle_progress_s)
        self._min_poll_s = float(min_poll_s)
        self._deregister_wait_s = float(deregister_wait_s)
        self._start_bookkeeping()
        self._worker = threading.Thread(target=self._run, name=f"nixl-{key}", daemon=True)
        self._worker.start()

    def _describe(self, host: str) -> NixlEngineDesc:
        return NixlEngineDesc(
            key=self.key,
            agent_metadata=self._agent.get_agent_metadata(),
            host=host,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )

    def _start_bookkeeping(self) -> None:
        """The locks, registrations, peers, use counts and queue, all empty."""
        # NIXL agents are made without thread synchronisation: every call takes this lock.
        self._agent_lock = threading.Lock()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # _busy changes
        self._mem_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._memory: dict[int, Registration] = {}
        self._peers: dict[str, Peer] = {}
        self._busy: Counter = Counter()  # ("mem", id) / ("peer", generation) -> transfers using it
        self._queue: PostQueue[Transfer] = PostQueue(most=None)
        self._stuck = False  # a transfer NIXL could not cancel at close: nothing may be freed

    # -- descriptors and registration ------------------------------------------
    def register_remote_engine(self, desc: NixlEngineDesc) -> None:
        """Load a peer's agent metadata; raises ``ValueError`` when NIXL refuses it or it names another agent.

        Registering the same descriptor again is a no-op; a new descriptor under a known
        key (the peer restarted) replaces the old one, whose sessions then fail.
        """
        done, known = self._known_remote(desc, self._peers, self._lock)
        if done:
            return
        if known is not None:
            self._withdraw(known)
        with self._agent_lock:
            try:
                name = self._agent.add_remote_agent(desc.agent_metadata)
            except Exception as exc:
                raise ValueError(
                    f"NIXL refused the metadata of engine {desc.key!r}: {type(exc).__name__}: {exc}"
                ) from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != desc.key:
                self._forget_agent(name)
                raise ValueError(f"the metadata of engine {desc.key!r} names NIXL agent {name!r}")
        with self._lock:
            self._peers[desc.key] = Peer(desc, next(self._generations))

    def deregister_remote_engine(self, desc: NixlEngineDesc) -> None:
        """Forget a peer: its sessions' later transfers fail; NIXL drops it once none is in flight."""
        self._check_engine_desc(desc)
        with self._lock:
            peer = self._peers.get(desc.key)
        if peer is not None:
            self._withdraw(peer)

    def _is_own(self, desc: NixlEngineDesc) -> bool:
        return desc.agent_metadata == self._desc.agent_metadata

    def _withdraw(self, peer: Peer) -> None:
        with self._wake:
            peer.withdrawn = True
            if self._peers.get(peer.desc.key) is peer:
                del self._peers[peer.desc.key]
            quiet = self._wait_idle(("peer", peer.generation))
        if quiet:
            with self._agent_lock:
                self._forget_agent(peer.desc.key)
        else:
            _log.warning(
                "remote engine %r: transfers still in flight after %.1f s; NIXL keeps it loaded",
                peer.desc.key,
                self._deregister_wait_s,
            )

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
        nbytes = check_registrable(tensor, "NixlEngine", "host memory (DRAM)")
        self._require_open("register_torch_tensor")
        address = tensor.data_ptr()
        with self._agent_lock:
            try:
                reg_descs = self._agent.register_memory([(address, nbytes, 0, "")], "DRAM")
                metadata = self._agent.get_partial_agent_metadata(reg_descs, False)
            except Exception as exc:
                raise ValueError(
                    f"NIXL refused to register {nbytes} bytes at {address:#x}: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
        with self._lock:
            mem_id = next(self._mem_ids)
            desc = NixlMemoryDesc(
                engine_key=self.key,
                mem_id=mem_id,
                address=address,
                size=nbytes,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(tensor.shape),
                metadata=metadata,
            )
            self._memory[mem_id] = Registration(desc, tensor, reg_descs)
        return desc

    def deregister_memory(self, mem: NixlMemoryDesc) -> None:
        """Stop this engine's transfers on ``mem``: later ones fail; waits for those in flight.

        Unknown (already deregistered) memory is ignored.
        """
        self._check_memory_desc(mem)
        with self._wake:
            registration = self._memory.pop(mem.mem_id, None)
            if registration is None:
                return
            quiet = self._wait_idle(("mem", mem.mem_id))
        if not quiet:
            _log.warning(
                "memory %s of engine %r: a transfer was still in flight after %.1f s; it stays "
                "registered and allocated",
                mem.mem_id,
                self.key,
                self._deregister_wait_s,
            )
            lingering.append(registration)
            return
        with self._agent_lock:
            self._deregister_natively(registration)

    def _deregister_natively(self, registration: Registration) -> None:
        try:
            self._agent.deregister_memory(registration.reg_descs)
        except Exception as exc:
            _log.warning(
                "NIXL could not deregister memory %s of engine %r: %s; it stays allocated",
                registration.desc.mem_id,
                self.key,
                exc,
            )
            lingering.append(registration)

    def _holds(self, mem: NixlMemoryDesc) -> bool:
        registration = self._memory.get(mem.mem_id)
        return registration is not None and registration.desc == mem

    def _peer_replaced(self, peer: Peer) -> str | None:
        if self._peers.get(peer.desc.key) is not peer:
            return f"remote engine {peer.desc.key!r} was deregistered or registered anew"
        return None

    # -- sessions ------------------------------------------------------------
    def create_session(self, local_mem, remote_mem) -> NixlSession | None:
        """A session, or None when a region or the remote engine is not registered or NIXL refuses it (logged)."""
        self._check_session_descs(local_mem, remote_mem)
        if self._closed:
            return None
        if local_mem.engine_key != self.key or not self._holds(local_mem):
            _log.warning(
                "create_session: local memory %s is not registered with engine %r",
                local_mem.mem_id,
                self.key,
            )
            return None
        if remote_mem.engine_key == self.key:
            if not self._holds(remote_mem):
                _log.warning(
                    "create_session: memory %s of engine %r is not registered",
                    remote_mem.mem_id,
                    self.key,
                )
                return None
            return NixlSession(self, local_mem, remote_mem, None)
        with self._lock:
            peer = self._peers.get(remote_mem.engine_key)
        if peer is None or peer.gone() is not None:
            _log.warning(
                "create_session: remote engine %r is not registered%s",
                remote_mem.engine_key,
                f" ({peer.gone()})" if peer is not None else "",
            )
            return None
        if remote_mem.mem_id not in peer.loaded:
            if not remote_mem.metadata:
                _log.warning(
                    "create_session: memory %s of engine %r carries no NIXL metadata",
                    remote_mem.mem_id,
                    remote_mem.engine_key,
                )
                return None
            with self._agent_lock:
                try:
                    name = self._agent.add_remote_agent(remote_mem.metadata)
                except Exception as exc:
                    _log.warning(
                        "create_session: NIXL refused the metadata of memory %s of engine %r: %s",
                        remote_mem.mem_id,
                        remote_mem.engine_key,
                        exc,
                    )
                    return None
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != remote_mem.engine_key:
                _log.warning(
                    "create_session: the metadata of memory %s of engine %r names NIXL agent %r",
                    remote_mem.mem_id,
                    remote_mem.engine_key,
                    name,
                )
                return None
            peer.loaded.add(remote_mem.mem_id)
        return NixlSession(self, local_mem, remote_mem, peer)

    # -- posting and completing ----------------------------------------------
    def _submit(self, session: NixlSession, op: str, batch: CheckedBatch) -> LocalTransferStatus:
        """Queue one checked batch for the engine's thread; returns its status at once."""
        posted = Transfer(LocalTransferStatus(), session, op, batch)
        with self._wake:
            reason = session.why_dead()
            if reason is None:
                for what in self._uses(posted):
                    self._busy[what] += 1
        if reason is not None:
            posted.settle(
                StatusCode.ERR_BAD_STATE if self._closed else StatusCode.ERR_RDMA_OP, reason
            )
            return posted.status
        posted.status.mark_in_progress()
        sequence = self._queue.number()
        if sequence is None or not self._queue.put(posted, sequence):
            self._finish(posted, StatusCode.ERR_BAD_STATE, closed_text(self.key))
        return posted.status

    @staticmethod
    def _uses(posted: Transfer) -> list[tuple]:
        session = posted.session
        uses = [("mem", session.local_mem.mem_id)]
        if session._peer is None:
            uses.append(("mem", session.remote_mem.mem_id))
        else:
            uses.append(("peer", session._peer.generation))
        return uses

    def _finish(
        self, posted: Transfer, code: int, message: str = "", *, transport_failed: bool = False
    ) -> None:
        """Settle a transfer and let go of what it used (the worker, or close)."""
        peer = posted.session._peer
        if transport_failed and peer is not None and peer.broken is None:
            # UCX does not bring an endpoint in error back: later transfers fail at once,
            # until the peer is registered again.
            peer.broken = (
                f"the transport to engine {peer.desc.key!r} failed ({posted.label}: {message})"
            )
        with self._wake:
            for what in self._uses(posted):
                self._busy[what] -= 1
            self._wake.notify_all()
        posted.settle(code, message)

    def close(self) -> None:
        """Fail every transfer still queued or in flight (ERR_BAD_STATE), then release NIXL's resources.

        Idempotent. When NIXL could not cancel a transfer, the agent and every registered
        tensor are kept for the life of the process instead of being freed under it.
        """
        with self._wake:
            if self._closed:
                return
            self._closed = True
        for posted in self._queue.close() or ():
            self._finish(posted, StatusCode.ERR_BAD_STATE, closed_text(self.key))
        if threading.current_thread() is not self._worker:
            self._worker.join()
        with self._lock:
            registrations, self._memory = list(self._memory.values()), {}
            peers, self._peers = list(self._peers.values()), {}
        if self._stuck:
            lingering.extend([self._agent, *registrations])
            return
        with self._agent_lock:
            for registration in registrations:
                self._deregister_natively(registration)
            for peer in peers:
                peer.withdrawn = True
                self._forget_agent(peer.desc.key)
        # The agent's destructor tears UCX down; nothing of ours can reach it any more.
        self._agent = None

    def _where(self) -> str:
        return f"host={self._host}"


def _check_settings(host: object, **seconds: float) -> None:
    """Refuse a host that is not a string and timings that are not seconds (the two waits: > 0)."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a string, got {type(host).__name__}")
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    idle_progress_s, transfer_timeout_s = seconds["idle_progress_s"], seconds["transfer_timeout_s"]
    if not idle_progress_s > 0 or not transfer_timeout_s > 0:
        raise ValueError(
            "idle_progress_s and transfer_timeout_s must be > 0 seconds, got "
            f"{idle_progress_s!r} and {transfer_timeout_s!r}"
        )
