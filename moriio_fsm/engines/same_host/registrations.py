"""The same-host engine's own registered memory: claimed (its whole pages shared where asked), locked resident,
published in the engine's registration table, offered to copy assist; and let go again.

Rules: memory is let go only after its table slot is withdrawn, which waits for peers' copies in flight; memory a
peer may still be copying into (the wait ran out, or pages stayed shared) is kept allocated for the life of the
process, so that such a copy lands in memory nobody uses: a leak, never a corruption.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch

from .copy_assist import AssistBoard
from .descriptors import CrossMemoryMemoryDesc
from .registry import PublishedRegistry
from .resident import pin_pages, unpin_pages
from .shared_pages import AdoptedPages, MemoryClaim, claim_memory

__all__ = ["Registrations"]

_log = logging.getLogger(__name__)

# Memory a peer may still have been copying when its owner let go of it (see the rules above).
_lingering: list[torch.Tensor] = []


@dataclass(frozen=True, slots=True)
class _Registration:
    desc: CrossMemoryMemoryDesc
    tensor: torch.Tensor  # held so the memory cannot be freed while peers may reach it
    claim: MemoryClaim
    pinned: bool = False

    def let_go(self, copies_ended: bool) -> bool:
        """Unlock the memory and release its claim, giving shared pages back to private memory
        once ``copies_ended``; False if pages stay shared (the memory must then never be freed)."""
        if self.pinned:
            unpin_pages(self.desc.address, self.desc.size)
        return self.claim.release(give_back=copies_ended)


class Registrations:
    """Every tensor one engine registered, by mem_id."""

    def __init__(
        self,
        key: str,
        pid: int,
        table: PublishedRegistry,
        *,
        share_pages: bool,
        pin_memory: bool,
        deregister_wait_s: float,
    ) -> None:
        self._key, self._pid, self._table = key, pid, table
        self._share_pages, self._pin_memory = share_pages, pin_memory
        self._deregister_wait_s = deregister_wait_s
        self._lock = threading.Lock()
        self._mem_ids = count(1)
        self._memory: dict[int, _Registration] = {}

    def get(self, mem_id: int) -> _Registration | None:
        with self._lock:
            return self._memory.get(mem_id)

    def add(
        self, tensor: torch.Tensor, nbytes: int, board: AssistBoard | None
    ) -> CrossMemoryMemoryDesc:
        """Register ``tensor`` (checked: contiguous, on the CPU, ``nbytes`` long); its descriptor."""
        with self._lock:
            mem_id = next(self._mem_ids)
        address = tensor.data_ptr()
        claim = claim_memory(address, nbytes, self._share_pages)
        pinned = self._pin_memory and pin_pages(address, nbytes, f"engine {self._key!r}")
        registration = None
        try:
            registration = self._publish(mem_id, tensor, nbytes, claim, pinned)
        finally:
            if registration is None:
                if pinned:
                    unpin_pages(address, nbytes)
                if not claim.release():
                    _lingering.append(tensor)
        if board is not None and claim.adopted is not None:
            self._offer(board, mem_id, address, claim.adopted)
        with self._lock:
            self._memory[mem_id] = registration
        return registration.desc

    def _publish(
        self, mem_id: int, tensor: torch.Tensor, nbytes: int, claim: MemoryClaim, pinned: bool
    ) -> _Registration:
        address, adopted = tensor.data_ptr(), claim.adopted
        slot = self._table.publish(mem_id, address, nbytes)
        shared: dict[str, Any] = (
            {}
            if adopted is None
            else dict(
                shared_fd=adopted.fd,
                shared_token=adopted.token,
                shared_start=adopted.start,
                shared_size=adopted.size,
            )
        )
        desc = CrossMemoryMemoryDesc(
            engine_key=self._key,
            mem_id=mem_id,
            slot=slot,
            pid=self._pid,
            address=address,
            size=nbytes,
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=tuple(tensor.shape),
            **shared,
        )
        return _Registration(desc, tensor, claim, pinned)

    def _offer(self, board: AssistBoard, mem_id: int, address: int, adopted: AdoptedPages) -> None:
        """Let the copy-assist helper write into the shared pages of this registration."""
        low = adopted.start - address
        try:
            board.add_dest(mem_id, address, low, low + adopted.size)
        except (
            OverflowError,
            RuntimeError,
        ) as exc:  # a full table (or closing): writers copy alone
            _log.warning("engine %r: memory %s gets no copy assist: %s", self._key, mem_id, exc)

    def remove(self, mem_id: int, board: AssistBoard | None) -> None:
        """Stop every transfer against ``mem_id``: waits for copies in flight, then lets the memory go.
        Unknown (already deregistered) memory is ignored."""
        with self._lock:
            registration = self._memory.pop(mem_id, None)
        if registration is None:
            return
        if board is not None:
            board.drop_dest(mem_id)  # waits for a peer's job being helped into it
        copies_ended = self._table.withdraw(registration.desc.slot, self._deregister_wait_s)
        if not copies_ended:
            _log.warning(
                "memory %s of engine %r: a peer was still copying after %.1f s; it stays allocated",
                mem_id,
                self._key,
                self._deregister_wait_s,
            )
        if not registration.let_go(copies_ended) or not copies_ended:
            _lingering.append(registration.tensor)

    def close(self) -> None:
        """Withdraw the whole table (waiting for peers' copies in flight) and let every registration go."""
        with self._lock:
            registrations, self._memory = list(self._memory.values()), {}
        copies_ended = self._table.close(self._deregister_wait_s)
        if not copies_ended:
            _log.warning(
                "engine %r closed while a peer was still copying; its memory stays allocated",
                self._key,
            )
        for registration in registrations:
            if not registration.let_go(copies_ended) or not copies_ended:
                _lingering.append(registration.tensor)
