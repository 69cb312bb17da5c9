"""The transfer-engine interface, mirroring mori.io's surface, and every hook the vLLM worker calls on an engine.

Rules: posting never blocks; wrong argument *values* come back as an already-failed status (ERR_INVALID_ARGS),
wrong *types* raise ``TypeError``. A hook an engine has no use for keeps its default here, which does nothing
and says so: the worker calls every hook on every engine, never probing for one.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Protocol,
    TypeVar,
    runtime_checkable,
)

from .checks import integer
from .status import TransferStatus, wait_all

if TYPE_CHECKING:
    from .faults import LoopbackFaults

__all__ = [
    "EngineDescT",
    "EngineDescriptor",
    "MemoryDescT",
    "MemoryDescriptor",
    "TransferEngine",
    "TransferSession",
]


# The descriptors' fields are read-only here: engines' descriptors are frozen.


@runtime_checkable
class EngineDescriptor(Protocol):
    """Identifies an engine to its peers; travels as ``pack()`` bytes."""

    @property
    def key(self) -> str: ...

    def pack(self) -> bytes: ...


@runtime_checkable
class MemoryDescriptor(Protocol):
    """Identifies one registered memory region; travels as ``pack()`` bytes."""

    @property
    def engine_key(self) -> str: ...

    @property
    def size(self) -> int: ...

    def pack(self) -> bytes: ...


#: An engine's own kinds of descriptor (it takes back only those it makes: another is a ``TypeError``).
EngineDescT = TypeVar("EngineDescT", bound=EngineDescriptor)
MemoryDescT = TypeVar("MemoryDescT", bound=MemoryDescriptor)


class TransferSession(abc.ABC):
    """A channel from one local registered region to one remote registered region.

    Offsets are byte offsets into the two regions. Every call returns at once
    with a status; ``batch_*`` returns one status for the whole batch.
    """

    #: Whether ``kill`` stops this session's transfers, those in flight included. An engine whose
    #: bytes are moved by a NIC or a library it cannot interrupt leaves it False: the machines then
    #: keep the blocks of an abandoned transfer out of use rather than free them under a copy.
    killable: bool = False

    @abc.abstractmethod
    def allocate_transfer_uid(self) -> int: ...

    @abc.abstractmethod
    def batch_write(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        transfer_uid: int,
    ) -> TransferStatus:
        """Copy local ranges into the remote region (one-sided)."""

    @abc.abstractmethod
    def batch_read(
        self,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        transfer_uid: int,
    ) -> TransferStatus:
        """Copy remote ranges into the local region (one-sided)."""

    def write(
        self, local_offset: int, remote_offset: int, size: int, transfer_uid: int
    ) -> TransferStatus:
        return self.batch_write(*_one_range(local_offset, remote_offset, size), transfer_uid)

    def read(
        self, local_offset: int, remote_offset: int, size: int, transfer_uid: int
    ) -> TransferStatus:
        return self.batch_read(*_one_range(local_offset, remote_offset, size), transfer_uid)

    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the session, its engine or its peer is known to be gone.

        An engine that hears of a peer's loss only through its own transfers (mori.io: a passive target never
        does) may answer True for a peer that is gone; the machines' timeouts end such a transfer.
        """

    def kill(self) -> None:
        """Break this session: its queued and later transfers fail, and a copy in progress stops where it can.

        Only where ``killable``; elsewhere it raises ``RuntimeError``, changing nothing.
        """
        raise RuntimeError(f"a {type(self).__name__} cannot stop a transfer in flight")


def _one_range(
    local_offset: int, remote_offset: int, size: int
) -> tuple[list[int], list[int], list[int]]:
    return (
        [integer("local_offset", local_offset)],
        [integer("remote_offset", remote_offset)],
        [integer("size", size)],
    )


class TransferEngine(abc.ABC, Generic[EngineDescT, MemoryDescT]):
    """One endpoint: registers memory, knows remote engines, opens sessions; generic in the kinds of
    descriptor it makes and takes back (``EngineDescT``, ``MemoryDescT``).

    ``create_session`` returns None (as mori does) when either region or the
    remote engine is unknown or unreachable. ``close`` is idempotent.

    Below the abstract methods, the hooks the vLLM worker calls: each default does nothing.
    """

    key: str

    #: The fault rules this engine takes (``engine.faults.fail_nth(3)``...), or None where it injects no faults.
    faults: LoopbackFaults | None = None

    #: Whether a post is copied on the thread that posts it, its status final on return: the caller
    #: then shares its core with every copy, and ``wait_for_copies`` lets one end.
    inline_copies: bool = False

    @abc.abstractmethod
    def get_engine_desc(self) -> EngineDescT: ...

    @abc.abstractmethod
    def unpack_engine_desc(self, packed: bytes) -> EngineDescT: ...

    @abc.abstractmethod
    def register_remote_engine(self, desc: EngineDescT) -> None: ...

    @abc.abstractmethod
    def deregister_remote_engine(self, desc: EngineDescT) -> None: ...

    @abc.abstractmethod
    def register_torch_tensor(self, tensor: Any) -> MemoryDescT: ...

    @abc.abstractmethod
    def deregister_memory(self, mem: MemoryDescT) -> None: ...

    @abc.abstractmethod
    def unpack_memory_desc(self, packed: bytes) -> MemoryDescT: ...

    @abc.abstractmethod
    def allocate_transfer_uid(self) -> int: ...

    @abc.abstractmethod
    def create_session(
        self, local_mem: MemoryDescT, remote_mem: MemoryDescT
    ) -> TransferSession | None: ...

    def wait_all(self, statuses: Iterable[TransferStatus], timeout_ms: int = -1) -> bool:
        """True when every status is final within ``timeout_ms`` (negative: no limit)."""
        return wait_all(statuses, timeout_ms)

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- hooks for the worker: what an engine may do better with a hint -------------------------

    def posting_together(self) -> contextlib.AbstractContextManager[None]:
        """A block whose posts on this thread the engine may carry out together when it ends.

        A status posted inside must not be waited for inside. By default each post goes its way at once.
        """
        return contextlib.nullcontext()

    def prepare_remote_memory(self, mem: MemoryDescT) -> None:
        """Make a peer's registered memory ready for its first session now (a handshake's work, off the
        posting thread). Never raises for a peer that is unknown or gone. By default there is nothing to do."""

    def help_writers(self, wait_s: float | None = None, linger_s: float | None = None) -> int:
        """Spend the caller's otherwise idle time on peers' writes into this engine's memory; the ranges
        copied. ``wait_s``: how long to wait for one; ``linger_s``: after helping, for the next (None: the
        engine's own figures). By default no peer is ever helped: 0 at once."""
        return 0

    def interrupt_help(self) -> None:
        """A ``help_writers`` call waiting for a write returns now (its caller has news to report)."""

    def wait_for_copies(self, timeout_s: float | None = None) -> bool:
        """Block until no copy of this engine runs, at most ``timeout_s`` (None: the engine's own figure);
        True if none runs. By default no copy runs on the caller's core: True at once."""
        return True
