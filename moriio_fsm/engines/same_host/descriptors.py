"""The same-host engine's descriptors: who an engine is (process, host, pid namespace, registration table, copy-assist
board), and each registered tensor (its slot, where it lives, the whole pages it shares).

Rules: they travel as tagged msgpack structs checked field by field (``TypeError`` for non-bytes, ``ValueError``
for anything else); a memory descriptor's shared pages lie within its memory, page-aligned.
"""

from __future__ import annotations

import mmap
from typing import Annotated

import msgspec

from ..checks import PackedDescriptor

__all__ = ["CrossMemoryEngineDesc", "CrossMemoryMemoryDesc"]

_Positive = Annotated[int, msgspec.Meta(gt=0)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Token = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{0,32}$")]


class CrossMemoryEngineDesc(PackedDescriptor, frozen=True, tag="moriio-cma-engine"):
    """Who a cross-memory engine is: its process, host, pid namespace and registration table."""

    key: str
    pid: _Positive
    boot_id: str
    pid_namespace: int
    registry_fd: _NonNegative
    token: bytes
    token_address: _Positive
    hostname: str = ""
    host: str = ""
    port: int = 0
    # Its copy-assist board (``copy_assist``): a memfd at this fd of the engine's process,
    # named with this token; -1: it offers none, and writers into it copy alone.
    assist_fd: int = -1
    assist_token: _Token = ""


class CrossMemoryMemoryDesc(PackedDescriptor, frozen=True, tag="moriio-cma-memory"):
    """One registered tensor: its owner, its slot in the owner's table, where it lives and how big it is."""

    engine_key: str
    mem_id: _Positive
    slot: _NonNegative
    pid: _Positive
    address: _Positive
    size: _Positive
    dtype: str
    shape: tuple[int, ...]
    # The whole pages of it the owner shares (``AdoptedPages``): a memfd at this fd of the
    # owner, named with this token, mapped at shared_start for shared_size bytes; -1: none.
    shared_fd: int = -1
    shared_token: _Token = ""
    shared_start: _NonNegative = 0
    shared_size: _NonNegative = 0

    def __post_init__(self) -> None:
        if self.shared_fd < 0:
            if self.shared_fd != -1 or self.shared_token or self.shared_start or self.shared_size:
                raise ValueError(
                    "shared_fd is -1 when no pages are shared, with no token, start or size"
                )
            return
        if not self.shared_token or self.shared_size == 0 or self.shared_start % mmap.PAGESIZE:
            raise ValueError("shared pages need a token, a size and a page-aligned start")
        if (
            self.shared_start < self.address
            or self.shared_start + self.shared_size > self.address + self.size
        ):
            raise ValueError(
                f"shared pages [{self.shared_start:#x}, +{self.shared_size}) lie outside the "
                f"memory [{self.address:#x}, +{self.size})"
            )

    @property
    def shares_pages(self) -> bool:
        return self.shared_fd >= 0
