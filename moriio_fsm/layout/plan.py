"""Turns a layer geometry plus local -> remote block ids into byte ranges to transfer.

Rules: computed with tensor operations over all blocks at once (no per-block Python
loop); offsets are bytes from the start of each side's layer tensor; block ids and
counts must be integers (never truncated floats or bools); lists of unequal length, ids
out of range and anything else refused raise a ``KVLayoutError`` naming the layer.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from moriio_fsm.layout.describe import describe_layer
from moriio_fsm.layout.geometry import KVLayout, KVLayoutError, LayerGeometry, layout_error
from moriio_fsm.layout.head_slice import HeadSlice, SliceRanges, slice_offsets, slice_ranges
from moriio_fsm.layout.kv_format import LayerKVFormat

BlockIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Byte ranges ``(local_offsets[i], remote_offsets[i], sizes[i])`` for one layer.

    Range ``i`` copies ``sizes[i]`` bytes starting ``local_offsets[i]`` bytes after the
    local layer tensor's first byte to ``remote_offsets[i]`` bytes after the remote one's.
    A plan is shared by every layer of equal geometry, so it cannot be changed: each
    tensor is a 1-D int64 CPU inference tensor (an in-place update raises
    ``RuntimeError``; ``clone()`` gives a writable copy) and ``lists`` hands out new lists.
    """

    local_offsets: torch.Tensor
    remote_offsets: torch.Tensor
    sizes: torch.Tensor

    def __len__(self) -> int:
        return int(self.sizes.numel())

    @cached_property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @cached_property
    def _columns(self) -> tuple[list[int], list[int], list[int]]:
        return self.local_offsets.tolist(), self.remote_offsets.tolist(), self.sizes.tolist()

    @property
    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """The three columns as Python int lists, as an RDMA engine's batch call wants them.

        Converted once per plan; every call returns fresh copies the caller may change.
        """
        local, remote, sizes = self._columns
        return local.copy(), remote.copy(), sizes.copy()


_INTEGER_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
    if hasattr(torch, name)
)
_INT64_MAX = 2**63 - 1


def read_block_ids(block_ids: BlockIds) -> torch.Tensor | str:
    """Block ids as a 1-D int64 CPU tensor (no copy when already one), or what is wrong.

    Integers only: floats, bools, strings and ids beyond int64 are never converted, and
    the returned text names the first offending dtype or element.
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dtype not in _INTEGER_DTYPES:
            return f"of dtype {block_ids.dtype}"
        return block_ids.reshape(-1).to(device="cpu", dtype=torch.int64)
    try:
        ids = torch.as_tensor(block_ids)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        ids = None
    if ids is not None and (ids.dtype in _INTEGER_DTYPES or ids.numel() == 0):
        return ids.reshape(-1).to(dtype=torch.int64)
    if ids is not None and not isinstance(block_ids, (list, tuple)):
        return f"of dtype {ids.dtype}"
    try:
        items = list(block_ids)
    except TypeError:
        return f"given as {type(block_ids).__name__}, not a sequence"
    for item in items:
        problem = _not_an_id(item)
        if problem:
            return problem
    return f"given as {type(block_ids).__name__} that does not convert to int64"


def _integer_or_none(value: Any) -> int | None:
    """``value`` as an ``int`` when it is a true integer (bools and bool tensors are not)."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _not_an_id(item: object) -> str:
    """Why ``item`` is no block id, or ``""`` when it is one."""
    value = _integer_or_none(item)
    if value is None:
        return f"containing {item!r} ({type(item).__name__})"
    if not -_INT64_MAX - 1 <= value <= _INT64_MAX:
        return f"containing {value}, which does not fit in int64"
    return ""


def read_block_count(value: object) -> int | str:
    """A block count as a non-negative ``int``, or what is wrong with it."""
    count = _integer_or_none(value)
    if count is None:
        return f"got remote_num_blocks={value!r} ({type(value).__name__})"
    if count < 0:
        return f"got remote_num_blocks={count}"
    return count


def block_ids_error(
    geometry: LayerGeometry, side: str, problem: str, num_blocks: object
) -> KVLayoutError:
    """The refusal of ``side``'s block ids for ``geometry``'s layer."""
    bound = f" in [0, {num_blocks})" if isinstance(num_blocks, int) else ""
    return layout_error(
        geometry.layer_name,
        geometry.shape,
        f"got {side} block ids {problem}",
        f"{side} block ids as integers (an integer dtype for a tensor){bound}",
    )


def block_count_error(geometry: LayerGeometry, problem: str) -> KVLayoutError:
    """The refusal of a remote block count for ``geometry``'s layer."""
    return layout_error(
        geometry.layer_name, geometry.shape, problem, "remote_num_blocks as a non-negative integer"
    )


def as_block_ids(block_ids: BlockIds) -> torch.Tensor:
    """Block ids as a 1-D int64 CPU tensor (no copy when already one).

    Raises ``KVLayoutError`` for anything but integers (no layer is known here;
    ``plan_transfer`` names the layer when it refuses ids).
    """
    ids = read_block_ids(block_ids)
    if isinstance(ids, str):
        raise KVLayoutError(
            f"block ids {ids}; expected integer block ids (an integer dtype for a tensor)"
        )
    return ids


def _check_ids(geometry: LayerGeometry, ids: torch.Tensor, side: str, num_blocks: int) -> None:
    if ids.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise layout_error(
            geometry.layer_name,
            geometry.shape,
            f"got {side} block id {bad} outside the {side} cache's {num_blocks} blocks",
            f"{side} block ids in [0, {num_blocks})",
        )


def merge_ranges(
    local_offsets: torch.Tensor, remote_offsets: torch.Tensor, sizes: torch.Tensor
) -> TransferPlan:
    """Merge each run of consecutive ranges that is contiguous on both sides into one range.

    Only neighbours in the given order are merged, so the pairing of local and remote
    bytes is exactly preserved.
    """
    with torch.inference_mode():
        return _merge_ranges(local_offsets, remote_offsets, sizes)


def _merge_ranges(
    local_offsets: torch.Tensor, remote_offsets: torch.Tensor, sizes: torch.Tensor
) -> TransferPlan:
    count = sizes.numel()
    if count < 2:
        return TransferPlan(local_offsets.clone(), remote_offsets.clone(), sizes.clone())
    ends_local = local_offsets[:-1] + sizes[:-1]
    ends_remote = remote_offsets[:-1] + sizes[:-1]
    continues = (local_offsets[1:] == ends_local) & (remote_offsets[1:] == ends_remote)
    starts = torch.ones(count, dtype=torch.bool)
    starts[1:] = ~continues
    first = starts.nonzero().reshape(-1)
    # A run's size is the sum of its members: difference of the running total at its ends.
    # index_select rather than tensor[index]: advanced indexing goes multi-threaded even
    # for a few thousand elements and stalls for milliseconds on a busy machine.
    running = torch.zeros(count + 1, dtype=sizes.dtype)
    torch.cumsum(sizes, 0, out=running[1:])
    bounds = torch.empty(first.numel() + 1, dtype=torch.int64)
    bounds[:-1] = first
    bounds[-1] = count
    totals = torch.index_select(running, 0, bounds)
    return TransferPlan(
        torch.index_select(local_offsets, 0, first),
        torch.index_select(remote_offsets, 0, first),
        totals[1:] - totals[:-1],
    )


def _pieces(geometry: LayerGeometry, coarsen: bool) -> tuple[list[int], int]:
    """Offsets (elements, from the scheduler block's start) and size of the ranges of one block.

    Uncoarsened: one range per physical block's K, V or latent piece. Coarsened (only
    used when merging anyway): pieces the geometry proves adjacent are fused up front,
    so a plan needs fewer rows; merging the fine ranges would give the same result.
    """
    ratio, stride, kv, piece = (
        geometry.kernel_blocks_per_block,
        geometry.block_stride,
        geometry.kv_stride,
        geometry.piece_elements,
    )
    if geometry.layout is KVLayout.INTERLEAVED:
        if coarsen and kv == piece:
            if stride == 2 * piece:
                return [0], 2 * piece * ratio
            return [part * stride for part in range(ratio)], 2 * piece
        return [part * stride + half for part in range(ratio) for half in (0, kv)], piece
    # Separated (within its K or V half), MLA and CPU_ATTN: physical blocks follow each other.
    if coarsen and stride == piece:
        return [0], piece * ratio
    return [part * stride for part in range(ratio)], piece


def _offsets(
    block_starts: torch.Tensor, sections: tuple[int, ...], pieces: torch.Tensor
) -> torch.Tensor:
    """Byte offsets ordered by (section, block, piece), computed in one broadcast."""
    offsets = block_starts.view(1, -1, 1) + pieces.view(1, 1, -1)
    if len(sections) > 1:
        offsets = offsets + torch.tensor(sections, dtype=torch.int64).view(-1, 1, 1)
    elif sections[0]:
        offsets = offsets + sections[0]
    return offsets.reshape(-1)


def plan_transfer(
    geometry: LayerGeometry,
    local_block_ids: BlockIds,
    remote_block_ids: BlockIds,
    remote_num_blocks: int,
    *,
    merge: bool = True,
    heads: HeadSlice | None = None,
) -> TransferPlan:
    """Byte ranges that copy ``local_block_ids[i]`` to ``remote_block_ids[i]`` for every i.

    The remote cache is assumed to have the local layout with ``remote_num_blocks``
    scheduler blocks packed the same way (so only a separated cache's V half moves).
    Without ``merge`` there is one range per physical block's K, V or latent piece,
    ordered K of every block then V of every block (separated), K then V per physical
    block (interleaved) or one per physical block (MLA, CPU_ATTN). With ``merge`` (default) every
    run of ranges contiguous on both sides is one range, in the same order.

    With ``heads`` (a ``HeadSlice`` of ratio k), the remote cache is this layout with k
    times the heads per block, and each local block lands in slice ``heads.index`` of its
    remote block's heads: one range per piece (heads outermost) or per token (NHD).

    Raises ``KVLayoutError`` when the lists differ in length, an id is not an integer
    or out of range, ``remote_num_blocks`` is not a non-negative integer, or ``heads``
    asks for a slice this layout cannot place exactly (MLA, heads innermost).
    """
    if heads is not None and not isinstance(heads, HeadSlice):
        raise TypeError(f"heads must be a HeadSlice or None, got {type(heads).__name__}")
    sliced = heads if heads is not None and heads.ratio > 1 else None
    with torch.inference_mode():
        # A slice the layout cannot place is refused before the ids are read.
        ranges = slice_ranges(geometry, sliced) if sliced is not None else None
        local, remote, count = _checked_ids(
            geometry,
            local_block_ids,
            remote_block_ids,
            remote_num_blocks,
            1 if sliced is None else sliced.ratio,
        )
        if sliced is not None and ranges is not None:
            return _plan_head_sliced(geometry, local, remote, count, sliced, ranges, merge)
        return _plan_transfer(geometry, local, remote, count, merge)


def _checked_ids(
    geometry: LayerGeometry,
    local_block_ids: BlockIds,
    remote_block_ids: BlockIds,
    remote_num_blocks: object,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Both id lists as int64 tensors and the remote count, checked against both caches (the
    remote one ``ratio`` times this layer's bytes per block)."""
    count = read_block_count(remote_num_blocks)
    if isinstance(count, str):
        raise block_count_error(geometry, count)
    local = read_block_ids(local_block_ids)
    if isinstance(local, str):
        raise block_ids_error(geometry, "local", local, geometry.num_blocks)
    remote = read_block_ids(remote_block_ids)
    if isinstance(remote, str):
        raise block_ids_error(geometry, "remote", remote, count)
    if local.numel() != remote.numel():
        raise layout_error(
            geometry.layer_name,
            geometry.shape,
            f"got {local.numel()} local block ids but {remote.numel()} remote block ids",
            "one remote block id per local block id",
        )
    remote_extent = geometry.extent_bytes(count) * ratio
    if remote_extent > _INT64_MAX:
        raise block_count_error(
            geometry,
            f"got remote_num_blocks={count}, which puts the remote cache ({remote_extent} bytes) "
            "beyond the int64 offsets a plan holds",
        )
    _check_ids(geometry, local, "local", geometry.num_blocks)
    _check_ids(geometry, remote, "remote", count)
    return local, remote, count


def _plan_transfer(
    geometry: LayerGeometry,
    local: torch.Tensor,
    remote: torch.Tensor,
    remote_num_blocks: int,
    merge: bool,
) -> TransferPlan:
    element = geometry.element_size
    piece_offsets, piece_elements = _pieces(geometry, coarsen=merge)
    pieces = torch.tensor(piece_offsets, dtype=torch.int64) * element
    block_span = geometry.block_stride * geometry.kernel_blocks_per_block * element
    local_sections: tuple[int, ...]
    remote_sections: tuple[int, ...]
    if geometry.layout is KVLayout.SEPARATED:
        local_sections = (0, geometry.kv_stride * element)
        remote_sections = (0, geometry.remote_kv_stride(remote_num_blocks) * element)
    else:
        local_sections = remote_sections = (0,)
    if merge and piece_offsets == [0] and piece_elements * element == block_span:
        return _merge_whole_blocks(local, remote, block_span, local_sections, remote_sections)
    local_offsets = _offsets(local * block_span, local_sections, pieces)
    remote_offsets = _offsets(remote * block_span, remote_sections, pieces)
    sizes = torch.full((local_offsets.numel(),), piece_elements * element, dtype=torch.int64)
    if merge:
        return _merge_ranges(local_offsets, remote_offsets, sizes)
    return TransferPlan(local_offsets, remote_offsets, sizes)


def _plan_head_sliced(
    geometry: LayerGeometry,
    local: torch.Tensor,
    remote: torch.Tensor,
    remote_num_blocks: int,
    heads: HeadSlice,
    ranges: SliceRanges,
    merge: bool,
) -> TransferPlan:
    """Ranges ordered by (section, block, piece, slice range): every per-block distance on the
    remote side is ``heads.ratio`` times ours, and each piece lands at its slice's place."""
    element, ratio = geometry.element_size, heads.ratio
    piece_offsets, _ = _pieces(geometry, coarsen=False)
    pieces = torch.tensor(piece_offsets, dtype=torch.int64) * element
    span = geometry.block_stride * geometry.kernel_blocks_per_block * element
    local_sections: tuple[int, ...]
    remote_sections: tuple[int, ...]
    if geometry.layout is KVLayout.SEPARATED:
        local_sections = (0, geometry.kv_stride * element)
        remote_sections = (0, geometry.remote_kv_stride(remote_num_blocks) * element * ratio)
    else:
        local_sections = remote_sections = (0,)
    local_in_piece, remote_in_piece = slice_offsets(ranges, element)
    local_offsets = _sliced_offsets(local * span, local_sections, pieces, local_in_piece)
    remote_offsets = _sliced_offsets(
        remote * (span * ratio), remote_sections, pieces * ratio, remote_in_piece
    )
    sizes = torch.full((local_offsets.numel(),), ranges.size * element, dtype=torch.int64)
    if merge:
        return _merge_ranges(local_offsets, remote_offsets, sizes)
    return TransferPlan(local_offsets, remote_offsets, sizes)


def _sliced_offsets(
    block_starts: torch.Tensor,
    sections: tuple[int, ...],
    pieces: torch.Tensor,
    in_piece: torch.Tensor,
) -> torch.Tensor:
    """Byte offsets ordered by (section, block, piece, range in piece), in one broadcast."""
    per_block = _offsets(block_starts, sections, pieces).view(-1, 1)
    return (per_block + in_piece.view(1, -1)).reshape(-1)


def _merge_whole_blocks(
    local: torch.Tensor,
    remote: torch.Tensor,
    block_span: int,
    local_sections: tuple[int, ...],
    remote_sections: tuple[int, ...],
) -> TransferPlan:
    """The merged plan when one range covers a whole block's span in each section.

    Two blocks' ranges in a section are then contiguous on both sides exactly when the
    next local and remote ids are both one higher, so runs are found on the ids alone,
    once for all sections; only a section's last and the next one's first range need
    a check of their own.
    """
    count = local.numel()
    starts = torch.ones(count, dtype=torch.bool)
    if count > 1:
        continues = torch.eq(local[1:], local[:-1] + 1)
        continues &= torch.eq(remote[1:], remote[:-1] + 1)
        torch.logical_not(continues, out=starts[1:])
    first = starts.nonzero().reshape(-1)
    bounds = torch.empty(first.numel() + 1, dtype=torch.int64)
    bounds[:-1] = first
    bounds[-1] = count
    sizes = (bounds[1:] - bounds[:-1]) * block_span
    local_starts = torch.index_select(local, 0, first) * block_span
    remote_starts = torch.index_select(remote, 0, first) * block_span
    if len(local_sections) == 1 or count == 0:
        return TransferPlan(local_starts, remote_starts, sizes)
    local_gap, remote_gap = local_sections[1], remote_sections[1]
    k_local_end = int(local_starts[-1]) + int(sizes[-1])
    k_remote_end = int(remote_starts[-1]) + int(sizes[-1])
    if (
        k_local_end == int(local_starts[0]) + local_gap
        and k_remote_end == int(remote_starts[0]) + remote_gap
    ):
        # The K half's last range runs straight on into the V half's first one.
        return _merge_ranges(
            torch.cat((local_starts, local_starts + local_gap)),
            torch.cat((remote_starts, remote_starts + remote_gap)),
            torch.cat((sizes, sizes)),
        )
    return TransferPlan(
        torch.cat((local_starts, local_starts + local_gap)),
        torch.cat((remote_starts, remote_starts + remote_gap)),
        torch.cat((sizes, sizes)),
    )


def plan_layer(
    layer_name: str,
    tensor: torch.Tensor,
    kv_format: LayerKVFormat,
    local_block_ids: BlockIds,
    remote_block_ids: BlockIds,
    remote_num_blocks: int,
    *,
    merge: bool = True,
    heads: HeadSlice | None = None,
) -> TransferPlan:
    """``describe_layer`` then ``plan_transfer``, uncached; see both for the guarantees."""
    geometry = describe_layer(layer_name, tensor, kv_format)
    return plan_transfer(
        geometry, local_block_ids, remote_block_ids, remote_num_blocks, merge=merge, heads=heads
    )
