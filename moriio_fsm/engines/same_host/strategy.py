"""How the same-host engine moves bytes: one interface over its three copies, and the names that select them.

The three, each a ``CopyStrategy``:

- ``KernelCopy`` (copying.py): the kernel's cross-memory copy, process_vm_writev / process_vm_readv, into the
  peer's memory wherever its process allocated it; checked by the kernel on every call, and every call pins
  each 4 KiB page again.
- ``PageCopy`` (copying.py): a memory copy into the peer's shared pages mapped here (``shared_pages``), with
  streaming stores where the native copier is built (``local_copy``).
- ``AssistedCopy`` (assisted.py): a large write into shared pages is put on the peer's job board and the
  peer's idle serving loop copies part of it while this side copies the rest (``copy_assist``).

Rules: a strategy moves the bytes of batches whose registrations its engine holds, all bound for one peer, and
says per batch whether they landed; one that does not take a group (``None``) leaves it to the next.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, TypedDict

__all__ = ["COPY_STRATEGIES", "CopyStrategy", "EngineOptions", "engine_options"]


class CopyStrategy(abc.ABC):
    """One way to move the bytes of held batches bound for one peer process."""

    name: ClassVar[str]

    @abc.abstractmethod
    def copy(self, op: str, pid: int, held: list[Any]) -> list[str | None] | None:
        """Move every batch of ``held`` (``SameHostPost``, registrations held, all bound for process ``pid``).

        Per batch: None when its bytes landed, else why they may not have. None for the whole group:
        this strategy does not take it, and the caller tries the next.
        """


class EngineOptions(TypedDict):
    """The ``CrossMemoryEngine`` options a copy strategy stands for (``copy_assist`` None: where built)."""

    share_pages: bool
    copy_assist: bool | None


#: What the connector's ``copy_strategy`` setting names, and the engine options it stands for. Each
#: option is the side being written into or read from's choice: an engine maps a peer's pages only if
#: that peer shares them, and posts to a board only if that peer offers one.
COPY_STRATEGIES: dict[str, EngineOptions] = {
    # Every copy by the kernel: nothing is shared beyond what ptrace permission already allows.
    "kernel": {"share_pages": False, "copy_assist": False},
    # Memory copies into shared pages; writers copy alone.
    "shared_pages": {"share_pages": True, "copy_assist": False},
    # Memory copies into shared pages, and large writes copied with the destination's help.
    "copy_assist": {"share_pages": True, "copy_assist": True},
}


def engine_options(strategy: str, share_pages: bool = True) -> EngineOptions:
    """``CrossMemoryEngine`` options for a strategy name, or for "auto": shared pages unless ``share_pages``
    is off, and copy assist where its native module is built (``copy_assist=None``)."""
    if strategy == "auto":
        return {"share_pages": bool(share_pages), "copy_assist": None if share_pages else False}
    try:
        return COPY_STRATEGIES[strategy].copy()
    except KeyError:
        raise ValueError(
            f"copy strategy must be 'auto' or one of {sorted(COPY_STRATEGIES)}, got {strategy!r}"
        ) from None
