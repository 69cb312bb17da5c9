"""The same-host engine's two plain copies: by the kernel into the peer's process, and by memory copy into the
peer's shared pages mapped here.

Rules: batches bound for one process go as one run of copies (their ranges as absolute addresses), which saves
a call and a hand-off per batch; if that fails each batch is copied alone again, so that each gets its own
outcome (a copy is idempotent: bytes already moved are moved again to the same place); a batch whose session
was killed meanwhile is copied no further; a large batch is split across the engine's copy threads.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from ..copy_split import CopyHelpers
from .iovec import SYSCALLS, CrossMemoryError, move_ranges
from .local_copy import copy_ranges
from .strategy import CopyStrategy
from .tuning import Tuning

__all__ = ["KernelCopy", "PageCopy", "RangeCopy"]


class RangeCopy(CopyStrategy):
    """Moves ranges between this process and a peer's memory; ``_move_ranges`` says how."""

    #: Whether the peer's memory is mapped here (remote addresses are where it is mapped).
    here: ClassVar[bool]
    #: Whether even one batch goes through the joint copy (the per-batch path repeats the checks).
    joint_for_one: ClassVar[bool]

    def __init__(self, helpers: CopyHelpers, tuning: Tuning) -> None:
        self._helpers = helpers
        self._tuning = tuning

    def copy(self, op: str, pid: int, held: list[Any]) -> list[str | None]:
        if len(held) > 1 or self.joint_for_one:
            try:
                self.move(op, pid, 0, 0, *_absolute_ranges(held, self.here))
                return [None] * len(held)
            except CrossMemoryError:
                pass  # each batch on its own below
        return [self._copy_one(op, pid, posted) for posted in held]

    def _copy_one(self, op: str, pid: int, posted: Any) -> str | None:
        session, batch = posted.session, posted.batch
        reason = session.why_dead()  # killed while the joint call ran: copy nothing more
        if reason is not None:
            return reason
        remote_base = session.mapped_remote_address if self.here else session.remote_mem.address
        try:
            self.move(
                op,
                pid,
                session.local_mem.address,
                remote_base,
                batch.local_offsets,
                batch.remote_offsets,
                batch.sizes,
                batch.total_bytes,
            )
        except CrossMemoryError as exc:
            return str(exc)
        return None

    def move(
        self,
        op: str,
        pid: int,
        local_base: int,
        remote_base: int,
        lo: list[int],
        ro: list[int],
        sizes: list[int],
        total_bytes: int,
    ) -> None:
        """Carry out ranges' copies on this thread, and on helper threads when they are many bytes.

        Runs while the registrations are held, so helpers need no locks of their own. The first
        error by range order is raised.
        """

        def copy_slice(a: int, b: int) -> None:
            self._move_ranges(
                op,
                pid,
                local_base,
                remote_base,
                lo[a:b],
                ro[a:b],
                sizes[a:b],
                range_base=a,
                bytes_base=sum(sizes[:a]),
            )

        self._helpers.run(copy_slice, sizes, total_bytes, self._tuning.parallel_copy_min_bytes)

    @abc.abstractmethod
    def _move_ranges(
        self,
        op: str,
        pid: int,
        local_base: int,
        remote_base: int,
        lo: list[int],
        ro: list[int],
        sizes: list[int],
        *,
        range_base: int,
        bytes_base: int,
    ) -> None:
        """Copy the ranges ("write": local to remote, "read": remote to local)."""


class KernelCopy(RangeCopy):
    """process_vm_writev / process_vm_readv into process ``pid`` (``iovec``)."""

    name = "kernel"
    here = False
    joint_for_one = False

    def _move_ranges(
        self, op, pid, local_base, remote_base, lo, ro, sizes, *, range_base, bytes_base
    ):
        move_ranges(
            SYSCALLS[op],
            pid,
            op,
            local_base,
            remote_base,
            lo,
            ro,
            sizes,
            range_base=range_base,
            bytes_base=bytes_base,
        )


class PageCopy(RangeCopy):
    """A memory copy into (or out of) the peer's shared pages mapped here. It cannot fail part-way: the
    pages are mapped for as long as the session that asked lives, and sealed against shrinking."""

    name = "shared_pages"
    here = True
    joint_for_one = True

    def _move_ranges(
        self, op, pid, local_base, remote_base, lo, ro, sizes, *, range_base, bytes_base
    ):
        if op == "write":
            copy_ranges(remote_base, ro, local_base, lo, sizes)
        else:
            copy_ranges(local_base, lo, remote_base, ro, sizes)


def _absolute_ranges(group: list[Any], here: bool) -> tuple[list[int], list[int], list[int], int]:
    """The ranges of several batches as absolute addresses (local, remote), sizes and their total.

    Remote addresses are the peer's own, or with ``here`` where its memory is mapped in this process.
    """
    local: list[int] = []
    remote: list[int] = []
    sizes: list[int] = []
    for posted in group:
        batch, session = posted.batch, posted.session
        local_base = session.local_mem.address
        remote_base = session.mapped_remote_address if here else session.remote_mem.address
        local.extend(local_base + offset for offset in batch.local_offsets)
        remote.extend(remote_base + offset for offset in batch.remote_offsets)
        sizes.extend(batch.sizes)
    return local, remote, sizes, sum(sizes)
