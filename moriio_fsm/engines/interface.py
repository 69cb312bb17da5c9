"""The transfer-engine interface, mirroring mori.io's surface: packed descriptors, sessions, uids, one status a batch.

Rules: posting never blocks; wrong argument *values* come back as an already-failed status (ERR_INVALID_ARGS),
wrong *types* raise ``TypeError``; nothing malformed ever reaches native code.
"""

from __future__ import annotations

import abc
import operator
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

from .status import StatusCode, TransferStatus, wait_all

__all__ = [
    "EngineDescriptor",
    "MemoryDescriptor",
    "TransferEngine",
    "TransferSession",
    "CheckedBatch",
    "ArgumentProblem",
    "check_transfer_batch",
]


@runtime_checkable
class EngineDescriptor(Protocol):
    """Identifies an engine to its peers; travels as ``pack()`` bytes."""

    key: str

    def pack(self) -> bytes: ...


@runtime_checkable
class MemoryDescriptor(Protocol):
    """Identifies one registered memory region; travels as ``pack()`` bytes."""

    engine_key: str
    size: int

    def pack(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class ArgumentProblem:
    """Why a transfer request was refused before anything was posted."""

    code: int
    message: str


@dataclass(frozen=True, slots=True)
class CheckedBatch:
    """A checked batch: equal-length lists of non-negative ints within both regions."""

    local_offsets: list[int]
    remote_offsets: list[int]
    sizes: list[int]
    transfer_uid: int

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def _integer(name: str, value: Any, expected: str = "an integer") -> int:
    """``value`` as an int; anything else, bool included, raises ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be {expected}, got {value!r} of type {type(value).__name__}")


def _int_list(name: str, values: Any) -> list[int]:
    if type(values) is list or type(values) is tuple:
        # What every caller passes: skip the Iterable check (an ABC check costs more than
        # the conversion), and copy so that a caller changing its list cannot change the batch.
        try:
            return list(map(operator.index, values))
        except TypeError:
            pass                           # the slow path names the element
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    values = list(values)
    try:
        return list(map(operator.index, values))
    except TypeError:
        # Only on failure: name the first element that is not an integer.
        for index, value in enumerate(values):
            if not isinstance(value, bool):
                _integer(f"{name}[{index}]", value)
        raise


def check_transfer_batch(
    local_offsets: Any,
    remote_offsets: Any,
    sizes: Any,
    transfer_uid: Any,
    *,
    local_size: int,
    remote_size: int,
) -> CheckedBatch | ArgumentProblem:
    """Check one batch against the two regions' sizes (bytes).

    Raises ``TypeError`` when an argument is not an integer (sequence); returns an
    ``ArgumentProblem`` (ERR_INVALID_ARGS) for lengths that differ, an empty
    batch, negative offsets or uid, sizes below 1, or a range past either region.
    """
    uid = _integer("transfer_uid", transfer_uid, "an integer from allocate_transfer_uid()")
    lo = _int_list("local_offsets", local_offsets)
    ro = _int_list("remote_offsets", remote_offsets)
    sz = _int_list("sizes", sizes)
    if not (len(lo) == len(ro) == len(sz)):
        return ArgumentProblem(
            StatusCode.ERR_INVALID_ARGS,
            f"local_offsets, remote_offsets and sizes must have equal lengths; "
            f"got {len(lo)}, {len(ro)} and {len(sz)}",
        )
    if not sz:
        return ArgumentProblem(StatusCode.ERR_INVALID_ARGS, "empty batch: sizes is empty")
    if uid < 0:
        return ArgumentProblem(StatusCode.ERR_INVALID_ARGS, f"transfer_uid must be >= 0, got {uid}")
    problem = (
        _range_problem("local", lo, sz, local_size) or _range_problem("remote", ro, sz, remote_size)
    )
    if problem is not None:
        return problem
    return CheckedBatch(lo, ro, sz, uid)


def _range_problem(side: str, offsets: list[int], sizes: list[int], region_size: int):
    smallest_size = min(sizes)
    if smallest_size < 1:
        index = sizes.index(smallest_size)
        return ArgumentProblem(
            StatusCode.ERR_INVALID_ARGS,
            f"sizes[{index}] is {smallest_size}; every size must be at least 1 byte",
        )
    smallest_offset = min(offsets)
    if smallest_offset < 0:
        index = offsets.index(smallest_offset)
        return ArgumentProblem(
            StatusCode.ERR_INVALID_ARGS,
            f"{side}_offsets[{index}] is {smallest_offset}; offsets must be >= 0",
        )
    ends = list(map(operator.add, offsets, sizes))
    furthest = max(ends)
    if furthest > region_size:
        index = ends.index(furthest)
        return ArgumentProblem(
            StatusCode.ERR_INVALID_ARGS,
            f"{side} range {index} [{offsets[index]}, {furthest}) ends past the "
            f"{side} region of {region_size} bytes",
        )
    return None


class TransferSession(abc.ABC):
    """A channel from one local registered region to one remote registered region.

    Offsets are byte offsets into the two regions. Every call returns at once
    with a status; ``batch_*`` returns one status for the whole batch.
    """

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

    def write(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self.batch_write(
            [_integer("local_offset", local_offset)],
            [_integer("remote_offset", remote_offset)],
            [_integer("size", size)],
            transfer_uid,
        )

    def read(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        return self.batch_read(
            [_integer("local_offset", local_offset)],
            [_integer("remote_offset", remote_offset)],
            [_integer("size", size)],
            transfer_uid,
        )

    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the session, its engine or its peer is gone."""


class TransferEngine(abc.ABC):
    """One endpoint: registers memory, knows remote engines, opens sessions.

    ``create_session`` returns None (as mori does) when either region or the
    remote engine is unknown or unreachable. ``close`` is idempotent.
    """

    key: str

    @abc.abstractmethod
    def get_engine_desc(self) -> EngineDescriptor: ...

    @abc.abstractmethod
    def unpack_engine_desc(self, packed: bytes) -> EngineDescriptor: ...

    @abc.abstractmethod
    def register_remote_engine(self, desc: EngineDescriptor) -> None: ...

    @abc.abstractmethod
    def deregister_remote_engine(self, desc: EngineDescriptor) -> None: ...

    @abc.abstractmethod
    def register_torch_tensor(self, tensor: Any) -> MemoryDescriptor: ...

    @abc.abstractmethod
    def deregister_memory(self, mem: MemoryDescriptor) -> None: ...

    @abc.abstractmethod
    def unpack_memory_desc(self, packed: bytes) -> MemoryDescriptor: ...

    @abc.abstractmethod
    def allocate_transfer_uid(self) -> int: ...

    @abc.abstractmethod
    def create_session(
        self, local_mem: MemoryDescriptor, remote_mem: MemoryDescriptor
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


def require_bytes(name: str, packed: Any) -> bytes:
    """Descriptors unpack only from bytes-like input; anything else is a caller bug."""
    if not isinstance(packed, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be bytes from .pack(), got {type(packed).__name__}")
    return bytes(packed)
