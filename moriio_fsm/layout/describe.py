"""Reads a layer's KV cache tensor and its format into a ``LayerGeometry``.

Rules: only shape, strides and dtype are read (never the data, so meta tensors work);
every shape this module cannot place exactly is rejected with a ``KVLayoutError``
naming the layer, the shape and what was expected; it never guesses.

Supported layouts (N blocks, B tokens per block, H heads, D head size, L latent size):

- separated K/V ``[2, N, B, H, D]`` or ``[2, N, H, B, D]``
- interleaved K/V ``[N, 2, B, H, D]`` or ``[N, 2, H, B, D]``
- MLA / index-only ``[N, B, L]``
- the CPU attention backend's ``[N, H, B, 2*D]`` (only with ``attention_backend="CPU_ATTN"``
  in the format; each block is one run of kernel-packed K and V, moved whole)

In every family the kernel may use blocks of ``kbs`` tokens smaller than the format's
``block_size``; the tensor then holds ``block_size / kbs`` physical blocks per
scheduler block, consecutive in the block axis. Whether the strides put K and V in two
halves or side by side decides the family used for planning, not the axis order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moriio_fsm.layout.geometry import KVLayout, KVLayoutError, LayerGeometry, layout_error
from moriio_fsm.layout.kv_format import CPU_ATTN, LayerKVFormat

_SHAPE_DETECTED_LAYOUTS = (
    "[2, N, B, H, D], [2, N, H, B, D], [N, 2, B, H, D], [N, 2, H, B, D], MLA [N, B, L]"
)


@dataclass(frozen=True)
class _Cache:
    """What every check reads of one layer's tensor, read once: its name, shape and strides."""

    layer_name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def refuse(self, problem: str, expected: str) -> KVLayoutError:
        """The error for this layer's tensor: what is wrong with it and what was expected."""
        return layout_error(self.layer_name, self.shape, problem, expected)


def _dense_elements(shape: Sequence[int], stride: Sequence[int]) -> int | None:
    """Element count when the axes tile one contiguous run in some order, else None."""
    expected = 1
    for size, step in sorted(
        (pair for pair in zip(shape, stride) if pair[0] != 1), key=lambda p: p[1]
    ):
        if step != expected:
            return None
        expected *= size
    return expected


def _token_axis(cache: _Cache, kv_format: LayerKVFormat) -> int:
    """Pick axis 2 or 3 of a 5-D cache as the tokens-per-physical-block axis."""
    shape = cache.shape
    if kv_format.num_kv_heads is not None:
        heads_axes = [axis for axis in (2, 3) if shape[axis] == kv_format.num_kv_heads]
        if not heads_axes:
            raise cache.refuse(
                f"has no axis 2 or 3 of size num_kv_heads={kv_format.num_kv_heads}",
                "[.., B, H, D] or [.., H, B, D] with H equal to the format's num_kv_heads",
            )
        # When both axes equal the head count they also equal each other, so either
        # choice gives the same kernel block size.
        return 3 if heads_axes[0] == 2 else 2
    candidates = [axis for axis in (2, 3) if kv_format.block_size % shape[axis] == 0]
    if not candidates:
        raise cache.refuse(
            f"has no axis 2 or 3 whose size divides block_size={kv_format.block_size}",
            "a block axis of block_size tokens or a kernel block size dividing it",
        )
    if len({shape[axis] for axis in candidates}) > 1:
        raise cache.refuse(
            f"is ambiguous: axes 2 and 3 ({shape[2]}, {shape[3]}) both divide block_size="
            f"{kv_format.block_size} and the format gives no num_kv_heads to tell the heads axis",
            "a format with num_kv_heads (and head_size) set",
        )
    return candidates[0]


def _kernel_ratio(cache: _Cache, kv_format: LayerKVFormat, token_axis: int, block_axis: int) -> int:
    shape = cache.shape
    kernel_block_size = shape[token_axis]
    if kernel_block_size == 0 or kv_format.block_size % kernel_block_size:
        raise cache.refuse(
            f"has {kernel_block_size} tokens per block on axis {token_axis}, which does not divide "
            f"block_size={kv_format.block_size}",
            "block_size itself or a kernel block size dividing it",
        )
    ratio = kv_format.block_size // kernel_block_size
    if shape[block_axis] % ratio:
        raise cache.refuse(
            f"has {shape[block_axis]} physical blocks, not a multiple of block_size/kernel block size = {ratio}",
            f"a block axis (axis {block_axis}) that is a multiple of {ratio}",
        )
    return ratio


def describe_layer(
    layer_name: str, tensor: torch.Tensor, kv_format: LayerKVFormat
) -> LayerGeometry:
    """Detect ``tensor``'s layout and geometry, or raise ``KVLayoutError`` saying why not.

    Guarantees of a returned geometry: the K (V, latent) data of every physical block is
    one contiguous run of ``piece_elements`` elements; no two runs overlap; the byte
    offset of a run from ``tensor.data_ptr()`` is exactly what ``plan_transfer``
    computes. Only ``shape``, ``stride()`` and ``dtype`` are read.
    """
    shape = tuple(int(size) for size in tensor.shape)
    stride = tuple(int(step) for step in tensor.stride())
    cache = _Cache(layer_name, tensor, shape, stride)
    if any(step < 0 for step in stride):
        raise cache.refuse(f"has negative strides {stride}", "non-negative strides")
    inner_axes = {3: (1, 2), 4: (1, 2, 3), 5: (2, 3, 4)}.get(tensor.dim(), ())
    empty = [axis for axis in inner_axes if shape[axis] == 0]
    if empty:
        raise cache.refuse(
            f"has an empty axis {empty[0]}, so a block would hold no data",
            "at least one token, head and element per block; only the block axis may be empty",
        )
    if kv_format.cpu_attention:
        return _describe_cpu_attn(cache, kv_format)
    if tensor.dim() == 3:
        if not kv_format.use_mla:
            raise cache.refuse(
                "has 3 axes but the kv_format is not MLA",
                "5 axes [2, N, B, H, D] / [N, 2, B, H, D] for a K/V layer, or use_mla=True for [N, B, L]",
            )
        return _describe_mla(cache, kv_format)
    if tensor.dim() == 5:
        if kv_format.use_mla:
            raise cache.refuse(
                "has 5 axes but the kv_format is MLA",
                "3 axes [N, B, L] for an MLA layer",
            )
        return _describe_kv(cache, kv_format)
    if tensor.dim() == 4:
        raise cache.refuse(
            "has 4 axes, but the kv_format names no attention backend with a 4-D cache",
            f"attention_backend={CPU_ATTN!r} in the kv_format for the CPU backend's [N, H, B, 2*D] cache, "
            f"or one of {_SHAPE_DETECTED_LAYOUTS}",
        )
    raise cache.refuse(
        f"has {tensor.dim()} axes, which is no supported layout",
        f"{_SHAPE_DETECTED_LAYOUTS} or CPU_ATTN [N, H, B, 2*D]",
    )


def _describe_cpu_attn(cache: _Cache, kv_format: LayerKVFormat) -> LayerGeometry:
    shape, stride = cache.shape, cache.stride
    expected = (
        "[num_blocks, num_kv_heads, block_size, 2*head_size] (the CPU attention backend's cache)"
    )
    if cache.tensor.dim() != 4:
        raise cache.refuse(
            f"has {cache.tensor.dim()} axes but the kv_format is {CPU_ATTN}", expected
        )
    if kv_format.num_kv_heads is not None and shape[1] != kv_format.num_kv_heads:
        raise cache.refuse(
            f"has {shape[1]} heads on axis 1, not the format's "
            f"num_kv_heads={kv_format.num_kv_heads}",
            expected,
        )
    if shape[3] % 2:
        raise cache.refuse(
            f"has an odd last axis {shape[3]}, which cannot hold K and V",
            expected,
        )
    if kv_format.head_size is not None and shape[3] != 2 * kv_format.head_size:
        raise cache.refuse(
            f"has last axis {shape[3]}, not 2*head_size={2 * kv_format.head_size}",
            expected,
        )
    ratio = _kernel_ratio(cache, kv_format, token_axis=2, block_axis=0)
    # The kernel's packing inside a block is only known for a row-major [H, B, 2*D] block;
    # any other stride order would be a view whose bytes are not the kernel's blocks.
    piece = shape[1] * shape[2] * shape[3]
    row_major = (shape[2] * shape[3], shape[3], 1)
    if any(
        size != 1 and step != want for size, step, want in zip(shape[1:], stride[1:], row_major)
    ):
        raise cache.refuse(
            f"has strides {stride} under which a block is not one row-major [H, B, 2*D] run",
            f"{expected}, each block contiguous",
        )
    return _one_piece_geometry(cache, KVLayout.CPU_ATTN, token_axis=2, ratio=ratio, piece=piece)


def _describe_mla(cache: _Cache, kv_format: LayerKVFormat) -> LayerGeometry:
    shape, stride = cache.shape, cache.stride
    # head_size is not checked here: quantised MLA caches store a packed latent whose
    # byte length differs from the model's latent size.
    ratio = _kernel_ratio(cache, kv_format, token_axis=1, block_axis=0)
    piece = _dense_elements(shape[1:], stride[1:])
    if piece is None:
        raise cache.refuse(
            f"has strides {stride} that split a block's data",
            "each block [B, L] contiguous",
        )
    return _one_piece_geometry(cache, KVLayout.MLA, token_axis=1, ratio=ratio, piece=piece)


def _one_piece_geometry(
    cache: _Cache, layout: KVLayout, *, token_axis: int, ratio: int, piece: int
) -> LayerGeometry:
    """A layout whose physical block is one piece holding all its data (MLA, CPU_ATTN): blocks
    on axis 0 and no K/V axis; refused when blocks overlap."""
    shape, stride = cache.shape, cache.stride
    if shape[0] > 1 and stride[0] < piece:
        raise cache.refuse(
            f"has block stride {stride[0]} < block size {piece}, so blocks overlap",
            "blocks that do not overlap",
        )
    return _geometry(
        cache,
        layout,
        kv_axis=None,
        token_axis=token_axis,
        kernel_blocks_per_block=ratio,
        num_physical_blocks=shape[0],
        piece_elements=piece,
        block_stride=stride[0] if shape[0] > 1 else piece,
        kv_stride=0,
    )


def _geometry(cache: _Cache, layout: KVLayout, **placement: Any) -> LayerGeometry:
    """A ``LayerGeometry``: what every layout reads off the tensor, and its own ``placement``
    of blocks, pieces and K/V."""
    return LayerGeometry(
        layer_name=cache.layer_name,
        layout=layout,
        shape=cache.shape,
        stride=cache.stride,
        dtype=cache.tensor.dtype,
        element_size=cache.tensor.element_size(),
        **placement,
    )


def _describe_kv(cache: _Cache, kv_format: LayerKVFormat) -> LayerGeometry:
    shape, stride = cache.shape, cache.stride
    kv_axis = _kv_axis(cache, kv_format)
    block_axis = 1 - kv_axis
    if kv_format.head_size is not None and shape[4] != kv_format.head_size:
        raise cache.refuse(
            f"has last axis {shape[4]}, not the format's head_size={kv_format.head_size}",
            f"[.., {kv_format.head_size}] as the last axis",
        )
    token_axis = _token_axis(cache, kv_format)
    ratio = _kernel_ratio(cache, kv_format, token_axis, block_axis)
    piece = _dense_elements(shape[2:], stride[2:])
    if piece is None:
        raise cache.refuse(
            f"has strides {stride} that split a block's K or V",
            "the three inner axes of each block's K and V contiguous in some order",
        )
    num_physical = shape[block_axis]
    layout, block_stride, kv_stride = _kv_placement(cache, kv_axis, piece)
    return _geometry(
        cache,
        layout,
        kv_axis=kv_axis,
        token_axis=token_axis,
        kernel_blocks_per_block=ratio,
        num_physical_blocks=num_physical,
        piece_elements=piece,
        block_stride=block_stride,
        kv_stride=kv_stride,
    )


def _kv_axis(cache: _Cache, kv_format: LayerKVFormat) -> int:
    """The axis (0 or 1) that splits K from V: the format's, or the one of size 2."""
    shape = cache.shape
    kv_axis = kv_format.kv_axis
    if kv_axis is None:
        if shape[0] == 2 and shape[1] == 2:
            raise cache.refuse(
                "is ambiguous: both axis 0 and axis 1 have size 2, so either could split K from V",
                "a format with kv_axis=0 ([2, N, ...]) or kv_axis=1 ([N, 2, ...])",
            )
        if shape[0] == 2:
            return 0
        if shape[1] == 2:
            return 1
        raise cache.refuse(
            "has no K/V axis of size 2 at axis 0 or 1",
            "[2, N, B, H, D], [2, N, H, B, D], [N, 2, B, H, D] or [N, 2, H, B, D]",
        )
    if shape[kv_axis] != 2:
        raise cache.refuse(
            f"has size {shape[kv_axis]} on the format's kv_axis={kv_axis}",
            f"size 2 on axis {kv_axis}",
        )
    return kv_axis


def _kv_placement(cache: _Cache, kv_axis: int, piece: int) -> tuple[KVLayout, int, int]:
    """Where K and V sit: the layout (two halves or side by side), the block stride and the
    K-to-V stride; refused when the K/V data of different blocks overlap."""
    shape, stride = cache.shape, cache.stride
    block_axis = 1 - kv_axis
    num_physical = shape[block_axis]
    block_stride, kv_stride = stride[block_axis], stride[kv_axis]
    if num_physical > 1:
        # The stride order, not the axis order, decides whether K and V sit in two halves.
        layout = KVLayout.SEPARATED if kv_stride > block_stride else KVLayout.INTERLEAVED
    else:
        # A one-block cache has no meaningful block stride; trust the axis order and
        # assume blocks packed back to back, as a peer with more blocks would have them.
        layout = KVLayout.SEPARATED if kv_axis == 0 else KVLayout.INTERLEAVED
        block_stride = piece if layout is KVLayout.SEPARATED else kv_stride + piece
    if layout is KVLayout.SEPARATED:
        overlap = (num_physical > 1 and block_stride < piece) or kv_stride < block_stride * max(
            num_physical - 1, 0
        ) + piece
    else:
        overlap = kv_stride < piece or (num_physical > 1 and block_stride < kv_stride + piece)
    if overlap:
        raise cache.refuse(
            f"has strides {stride} under which K/V data of different blocks overlap",
            "non-overlapping K and V data per block",
        )
    return layout, block_stride, kv_stride
