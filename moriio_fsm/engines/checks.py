"""What callers hand an engine, checked before anything is posted: batches of ranges, packed descriptors, tensors.

Rules: wrong argument *values* of a batch come back as an ``ArgumentProblem`` (an engine turns it into an
already-failed status, ERR_INVALID_ARGS), wrong *types* raise ``TypeError``; nothing malformed ever reaches
native code.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from .status import StatusCode

__all__ = [
    "ArgumentProblem",
    "CheckedBatch",
    "PackedDescriptor",
    "check_registrable",
    "check_transfer_batch",
    "decode_descriptor",
    "integer",
    "require_bytes",
]


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


def integer(name: str, value: Any, expected: str = "an integer") -> int:
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
            pass  # the slow path names the element
    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    values = list(values)
    try:
        return list(map(operator.index, values))
    except TypeError:
        # Only on failure: name the first element that is not an integer.
        for index, value in enumerate(values):
            if not isinstance(value, bool):
                integer(f"{name}[{index}]", value)
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
    uid = integer("transfer_uid", transfer_uid, "an integer from allocate_transfer_uid()")
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
    problem = _range_problem("local", lo, sz, local_size) or _range_problem(
        "remote", ro, sz, remote_size
    )
    if problem is not None:
        return problem
    return CheckedBatch(lo, ro, sz, uid)


def _range_problem(side: str, offsets: list[int], sizes: list[int], region_size: int):
    problem = _below("sizes", sizes, 1, "every size must be at least 1 byte") or _below(
        f"{side}_offsets", offsets, 0, "offsets must be >= 0"
    )
    if problem is not None:
        return problem
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


def _below(name: str, values: list[int], floor: int, rule: str) -> ArgumentProblem | None:
    """The problem with the first of ``values`` at its smallest, if that is below ``floor``."""
    smallest = min(values)
    if smallest >= floor:
        return None
    return ArgumentProblem(
        StatusCode.ERR_INVALID_ARGS, f"{name}[{values.index(smallest)}] is {smallest}; {rule}"
    )


def require_bytes(name: str, packed: Any) -> bytes:
    """Descriptors unpack only from bytes-like input; anything else is a caller bug."""
    if not isinstance(packed, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be bytes from .pack(), got {type(packed).__name__}")
    return bytes(packed)


def decode_descriptor(what: str, kind: type, packed: Any):
    """A ``msgspec`` descriptor struct from its packed bytes; ``TypeError`` for non-bytes, ``ValueError`` naming
    ``what`` for bytes that are not such a descriptor."""
    data = require_bytes(what, packed)
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"{what} is not a packed {kind.__name__}: {exc}") from None


class PackedDescriptor(msgspec.Struct, frozen=True):
    """A descriptor that travels as msgpack bytes: a subclass names its ``tag``, whose last word says what
    it describes ("moriio-cma-engine": an engine); ``unpack`` takes only bytes of its own kind, every
    field checked."""

    def pack(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def unpack(cls, packed: Any):
        """Raises ``TypeError`` for non-bytes and ``ValueError`` for bytes that are not such a descriptor."""
        tag = cls.__struct_config__.tag
        return decode_descriptor(f"{str(tag).rpartition('-')[2]} descriptor", cls, packed)


def check_registrable(tensor: Any, engine: str, memory: str = "host memory") -> int:
    """The size in bytes of a contiguous, non-empty CPU tensor that ``engine`` (its class name) may register.

    Raises ``TypeError`` for a non-tensor and ``ValueError`` for a tensor that is not on the CPU, not
    contiguous or empty; ``memory`` names what the engine moves, for the message.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{engine} moves {memory} only; the tensor is on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"tensor of shape {tuple(tensor.shape)} with strides {tuple(tensor.stride())} "
            "must be contiguous to be registered (register a contiguous byte view of it)"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ValueError("an empty tensor cannot be registered")
    return nbytes
