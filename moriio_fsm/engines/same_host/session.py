"""A same-host session: one local registration to one of a peer's, with where the peer's memory is mapped here
(its shared pages), and a batch posted on it.

Rules: a copy runs only between ``_hold`` and ``_let_go`` (both registrations held in their owners' tables); a
killed session's native copies stop at their next piece (its stop word); a refused or cut-short copy fails with
ERR_BAD_STATE while the engine closes, else ERR_RDMA_OP.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from ..base import SessionBase
from ..checks import CheckedBatch
from ..inflight import Posted, closed_text
from ..status import StatusCode
from .copy_assist import DESC_MAX
from .descriptors import CrossMemoryMemoryDesc
from .peers import Peer
from .registry import RegistryView

__all__ = ["CrossMemorySession", "SameHostPost"]


@dataclass(slots=True, eq=False)
class SameHostPost(Posted):
    """A batch posted on a same-host session."""

    here: bool = (
        False  # the copy is a memory copy in this process (the peer's pages are mapped here)
    )
    # (the peer's board, the job) of a write put there when posted; its registrations are held until it ends.
    job: tuple | None = None
    # When its copy ended (time.monotonic), set by the copy: its status is settled with it later.
    ended_at: float | None = None


class CrossMemorySession(SessionBase):
    """A channel from one local registered tensor to one registered tensor of a peer engine on this host."""

    killable = True

    def __init__(
        self,
        engine: Any,
        local: CrossMemoryMemoryDesc,
        remote: CrossMemoryMemoryDesc,
        peer: Peer,
        own_table: RegistryView,
        local_plain: bool = False,
    ) -> None:
        super().__init__(engine, local, remote)
        self.peer = peer
        self._own_table = own_table  # the engine's own registration table, where local_mem is held
        # Where the remote memory can be reached in this process, if it can: a peer's pages
        # mapped here (held by the session, so they stay mapped while it lives), and only
        # when the local memory is plain memory a copy cannot fault on.
        self._pages = None
        self.mapped_remote_address: int | None = None
        self._here_low = self._here_high = 0  # remote offsets the mapping covers
        self._segment: tuple | None = None
        self._stopped = ctypes.c_uint32(0)  # see stop_word
        if local_plain and remote.shares_pages and (pages := peer.pages_of(remote)) is not None:
            self._pages = pages
            self.mapped_remote_address = pages.address - remote.shared_start + remote.address
            self._here_low = remote.shared_start - remote.address
            self._here_high = self._here_low + remote.shared_size
        if peer.board is not None and (segment := self.assist_segment()) is not None:
            # Mapped by the peer before this session's first write, which it can then help with.
            peer.introduce(segment)

    def assist_segment(self) -> tuple | None:
        """How a copy-assist job names this session's two registrations (``_copy_assist.post``);
        None where the peer cannot be helped to them (no shared pages here or there, or a
        descriptor longer than a board holds)."""
        if (
            self._segment is None
            and self.mapped_remote_address is not None
            and self.local_mem.shares_pages
        ):
            local = self.local_mem
            packed = local.pack()
            if len(packed) <= DESC_MAX:
                self._segment = (
                    local.pid,
                    local.mem_id,
                    local.shared_token.encode(),
                    self.remote_mem.mem_id,
                    packed,
                    self.mapped_remote_address,
                    local.address,
                )
        return self._segment

    def helpable(self, batch: CheckedBatch) -> bool:
        """Whether the peer can copy ``batch`` for this session: every local range lies in this
        memory's shared pages (all the peer maps of it); the remote ones were checked on posting."""
        local = self.local_mem
        if self.assist_segment() is None:
            return False
        low = local.shared_start - local.address
        high = low + local.shared_size
        offsets = batch.local_offsets
        return min(offsets) >= low and max(map(int.__add__, offsets, batch.sizes)) <= high

    def copies_here(self, batch: CheckedBatch) -> bool:
        """Whether every remote range of ``batch`` lies where this process can reach it."""
        if self.mapped_remote_address is None:
            return False
        offsets = batch.remote_offsets
        return (
            min(offsets) >= self._here_low
            and max(map(int.__add__, offsets, batch.sizes)) <= self._here_high
        )

    @property
    def stop_word(self) -> int:
        """The address of a word that turns non-zero once this session is killed: native copies
        of its jobs check it between pieces, without the GIL."""
        return ctypes.addressof(self._stopped)

    def note_killed(self) -> None:
        """Called by the fault rules when this session is killed: its copies in progress stop."""
        self._stopped.value = 1

    def kill(self) -> None:
        """Break this session (same as ``engine.faults.kill_session(self)``)."""
        self._engine.faults.kill_session(self)

    def alive(self) -> bool:
        local, remote = self.local_mem, self.remote_mem
        return (
            self.why_dead() is None
            and self._own_table.holds(local.slot, local.mem_id, local.address, local.size)
            and self.peer.registry.holds(remote.slot, remote.mem_id, remote.address, remote.size)
        )

    def why_dead(self) -> str | None:
        if self._engine.closed:
            return "engine is closed"
        return self._engine.faults.session_fault(self) or self.peer.gone()

    def hold(self) -> tuple[int, str] | None:
        """Hold both registrations for a copy; the failure that forbids it, or None (then ``let_go`` after)."""
        reason = self.why_dead()
        if reason is not None:
            return self.failure(reason)
        local, remote = self.local_mem, self.remote_mem
        own_table = self._own_table
        if not own_table.hold(local.slot, local.mem_id, local.address, local.size):
            return self.failure(f"local memory {local.mem_id} was deregistered")
        if not self.peer.registry.hold(remote.slot, remote.mem_id, remote.address, remote.size):
            own_table.release(local.slot)
            return self.failure(
                f"remote memory {remote.mem_id} of engine {remote.engine_key!r} "
                "was deregistered (or its engine closed)"
            )
        return None

    def failure(self, reason: str) -> tuple[int, str]:
        """A refused or cut-short copy's outcome: ERR_BAD_STATE when this engine is closing (a
        transfer taken off the queue just before close ends as close ends the queued ones)."""
        if self._engine.closed:
            return StatusCode.ERR_BAD_STATE, closed_text(self._engine.key)
        return StatusCode.ERR_RDMA_OP, reason

    def let_go(self) -> None:
        self.peer.registry.release(self.remote_mem.slot)
        self._own_table.release(self.local_mem.slot)

    def after_copy(self) -> tuple[int, str]:
        # A pid is reused only after its process died; if it is still alive now, every
        # byte copied went to the process the descriptor names.
        reason = self.peer.gone()
        if reason is not None:
            return self.failure(f"{reason} (it ended during the transfer)")
        return StatusCode.SUCCESS, ""
