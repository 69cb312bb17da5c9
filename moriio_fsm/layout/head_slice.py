"""Head slices: where one rank's KV heads sit in a peer block that holds ``ratio`` times as many
(a P rank writing into a D rank of a k times smaller TP size holds 1/k of D's heads).

Rules: the peer's cache is this layout with ``ratio`` times the heads, packed the same way (dense
per block, same axis order in memory); our heads are the ``index``-th of ``ratio`` equal slices.
Heads-outer memory (HND, CPU_ATTN) gives one range per piece, tokens-outer memory (NHD) one range
per token; MLA has no heads to split and anything else cannot be placed exactly: both are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moriio_fsm.layout.geometry import KVLayout, KVLayoutError, LayerGeometry, layout_error


@dataclass(frozen=True)
class HeadSlice:
    """Our heads are slice ``index`` of ``ratio`` equal slices of the peer's heads.

    ``HeadSlice(2, 1)``: the peer holds twice our heads per block, ours are its second half.
    Raises ``ValueError`` on construction for anything but integers with
    ``0 <= index < ratio``.
    """

    ratio: int
    index: int

    def __post_init__(self) -> None:
        for name in ("ratio", "index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"HeadSlice.{name} must be an int, got {value!r}")
        if self.ratio < 1 or not 0 <= self.index < self.ratio:
            raise ValueError(
                f"HeadSlice needs ratio >= 1 and 0 <= index < ratio, "
                f"got ratio={self.ratio}, index={self.index}"
            )

    @classmethod
    def of_rank(cls, tp_rank: int, tp_size: int, peer_tp_size: int) -> HeadSlice | None:
        """The slice TP rank ``tp_rank`` of ``tp_size`` fills in a peer of ``peer_tp_size`` ranks,
        or None when the peer's ranks hold no more heads than ours (sizes equal or peer larger)."""
        if peer_tp_size >= tp_size or tp_size % peer_tp_size:
            return None
        ratio = tp_size // peer_tp_size
        return cls(ratio, tp_rank % ratio)


@dataclass(frozen=True)
class SliceRanges:
    """Ranges inside one physical piece, in elements: ours at ``local``, the peer's at ``remote``,
    each ``size`` long; the peer's piece is ``ratio`` times ours."""

    local: tuple[int, ...]
    remote: tuple[int, ...]
    size: int


def _refuse(geometry: LayerGeometry, problem: str) -> KVLayoutError:
    return layout_error(
        geometry.layer_name,
        geometry.shape,
        problem,
        "a K/V cache whose heads are outermost in a block (HND, CPU_ATTN: one range per block) "
        "or between tokens and head size (NHD: one range per token)",
    )


def _heads_outer(geometry: LayerGeometry, head_axis: int, heads: int) -> bool | None:
    """True for heads-outer memory, False for tokens-outer with the head size inner, None else."""
    shape, stride = geometry.shape, geometry.stride
    if geometry.layout is KVLayout.CPU_ATTN:
        return True  # describe_layer accepts only row-major [H, B, 2*D] blocks
    token_axis, piece = geometry.token_axis, geometry.piece_elements
    tokens, head_size = shape[token_axis], shape[4]
    if tokens == 1:
        return True  # one token per block: both orders are the same bytes
    if heads == 1:
        # A one-head axis keeps the stride of the allocation it is a view of, so it still
        # tells where the peer, holding more heads, puts them.
        heads_first = stride[head_axis] > stride[token_axis]
    else:
        heads_first = stride[head_axis] * heads == piece
    if heads_first:
        return True
    head_size_inner = head_size == 1 or stride[4] == 1
    heads_between = heads == 1 or stride[head_axis] == head_size
    if stride[token_axis] * tokens == piece and head_size_inner and heads_between:
        return False
    return None


def slice_ranges(geometry: LayerGeometry, heads: HeadSlice) -> SliceRanges:
    """Where our piece's bytes go in the peer's piece; ``KVLayoutError`` when no exact answer."""
    if geometry.layout is KVLayout.MLA:
        raise _refuse(
            geometry, "is an MLA (latent) cache, which has no heads to split across TP ranks"
        )
    head_axis = 1 if geometry.layout is KVLayout.CPU_ATTN else 5 - geometry.token_axis
    num_heads = geometry.shape[head_axis]
    outer = _heads_outer(geometry, head_axis, num_heads)
    if outer is None:
        raise _refuse(
            geometry,
            f"has strides {geometry.stride} under which one head's data is neither one run "
            "per block nor one run per token",
        )
    piece = geometry.piece_elements
    start = heads.index * piece  # our heads' place: index x our heads x one head's elements
    if outer:
        return SliceRanges((0,), (start,), piece)
    tokens = geometry.shape[geometry.token_axis]
    run = piece // tokens  # our heads' elements of one token
    return SliceRanges(
        tuple(token * run for token in range(tokens)),
        tuple(token * run * heads.ratio + heads.index * run for token in range(tokens)),
        run,
    )


def slice_offsets(ranges: SliceRanges, element_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The local and remote in-piece offsets of ``ranges`` as int64 byte tensors."""
    return (
        torch.tensor(ranges.local, dtype=torch.int64) * element_size,
        torch.tensor(ranges.remote, dtype=torch.int64) * element_size,
    )
