"""LayerGeometry: one layer's KV cache as physical blocks, pieces and K/V strides; its KVLayout
family; and KVLayoutError, what every layout problem raises (``describe.py`` reads a tensor into one).

Rules: frozen values read off shape, strides and dtype only (sizes in elements, ``*_bytes`` in
bytes); every message names the layer, the shape, the problem and what was expected.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import MoriioFsmError


class KVLayoutError(MoriioFsmError, ValueError):
    """A KV cache tensor, format or block list that cannot be planned exactly."""


def layout_error(
    layer_name: str, shape: Sequence[int], problem: str, expected: str
) -> KVLayoutError:
    """Build the project's standard message: layer, shape, problem, expectation."""
    return KVLayoutError(
        f"layer {layer_name!r}: KV cache of shape {tuple(shape)} {problem}; expected {expected}"
    )


class KVLayout(enum.Enum):
    """How the bytes of one block are arranged in memory."""

    SEPARATED = "separated"
    """All blocks' K first, then all blocks' V: two ranges per block, far apart."""

    INTERLEAVED = "interleaved"
    """Each block's K is followed by its V: two ranges per block, side by side."""

    MLA = "mla"
    """One latent (or index) vector per token: one range per block."""

    CPU_ATTN = "cpu_attn"
    """The CPU attention backend's blocks: K and V of every head packed by the kernel, one range per block."""


@dataclass(frozen=True)
class LayerGeometry:
    """Everything needed to turn block ids of one layer into byte ranges.

    Strides and sizes are in elements; ``*_bytes`` values are in bytes. A *piece* is
    the contiguous K (or V, or latent) data of one physical block; a scheduler block
    is ``kernel_blocks_per_block`` consecutive physical blocks.
    """

    layer_name: str
    layout: KVLayout
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    element_size: int
    kv_axis: int | None
    """Logical axis that splits K from V (None for MLA and CPU_ATTN)."""
    token_axis: int
    """Axis holding the tokens of one physical block."""
    kernel_blocks_per_block: int
    num_physical_blocks: int
    piece_elements: int
    block_stride: int
    kv_stride: int
    """Elements from a piece's K to its V (0 for MLA and CPU_ATTN, whose pieces hold both)."""

    @property
    def num_blocks(self) -> int:
        """Scheduler blocks this layer's cache holds."""
        return self.num_physical_blocks // self.kernel_blocks_per_block

    @property
    def piece_bytes(self) -> int:
        return self.piece_elements * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one scheduler block's K (or V, or latent) data."""
        return self.piece_bytes * self.kernel_blocks_per_block

    @property
    def axis_order(self) -> str:
        """``"NHD"`` when tokens precede heads, ``"HND"`` when heads come first, ``"NL"`` for MLA."""
        if self.layout is KVLayout.MLA:
            return "NL"
        if self.layout is KVLayout.CPU_ATTN:
            return "HND"
        return "NHD" if self.token_axis == 2 else "HND"

    def remote_kv_stride(self, remote_num_blocks: int) -> int:
        """Elements from a piece's K to its V on a peer holding ``remote_num_blocks`` blocks.

        A separated cache keeps its V half right after its K half, so the distance grows
        with the peer's block count; the other layouts keep it per block.
        """
        if self.layout is KVLayout.SEPARATED:
            return self.block_stride * remote_num_blocks * self.kernel_blocks_per_block
        return self.kv_stride

    def extent_bytes(self, num_blocks: int | None = None) -> int:
        """Bytes from the tensor's first element to just past its last block's data.

        With ``num_blocks`` given, the extent of the same layout holding that many
        scheduler blocks (the peer's cache) instead of this tensor's own.
        """
        physical = (
            self.num_physical_blocks
            if num_blocks is None
            else num_blocks * self.kernel_blocks_per_block
        )
        if physical == 0:
            return 0
        kv_stride = self.kv_stride if num_blocks is None else self.remote_kv_stride(num_blocks)
        last = (physical - 1) * self.block_stride + kv_stride + self.piece_elements
        return last * self.element_size
