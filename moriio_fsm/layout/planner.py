"""Per-transfer plan cache: layers of equal geometry share one computed plan.

Rules: a plan is looked up by (KV cache group, shape, strides, dtype, kv_format, remote block
count); the block ids are fixed when the planner is built for one transfer, so a plan
can never be served for other block ids or another geometry. Memory is bounded.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import cast

import torch

from moriio_fsm.layout.describe import describe_layer
from moriio_fsm.layout.head_slice import HeadSlice
from moriio_fsm.layout.kv_format import LayerKVFormat
from moriio_fsm.layout.plan import (
    BlockIds,
    TransferPlan,
    block_count_error,
    block_ids_error,
    plan_transfer,
    read_block_count,
    read_block_ids,
)


def _per_group(block_ids: BlockIds | Sequence[BlockIds]) -> list[BlockIds]:
    """One flat id list (one KV cache group) or a list of them (one per group)."""
    if isinstance(block_ids, torch.Tensor):
        return [block_ids] if block_ids.dim() <= 1 else list(block_ids)
    nested = len(block_ids) > 0 and (
        isinstance(block_ids[0], (list, tuple)) or getattr(block_ids[0], "ndim", 0) >= 1
    )
    # The test above tells which of the two it is; the types cannot.
    return list(cast(Sequence[BlockIds], block_ids)) if nested else [cast(BlockIds, block_ids)]


def _owned(ids: torch.Tensor | str) -> torch.Tensor | str:
    return ids.clone() if isinstance(ids, torch.Tensor) else ids


def geometry_key(tensor: torch.Tensor, kv_format: LayerKVFormat) -> tuple[Hashable, ...]:
    """What decides a layer's byte ranges apart from block ids: shape, strides, dtype, kv_format.

    The storage offset is left out on purpose: offsets are measured from each tensor's
    own first byte, so two views at different places with equal geometry plan alike.
    """
    return (tensor.shape, tensor.stride(), tensor.dtype, kv_format)


class TransferPlanner:
    """Plans every layer of one transfer (local blocks -> one peer's blocks).

    ``local_block_ids`` and ``remote_block_ids`` are a flat list for one KV cache group
    or one list per group, as in the ``remote_blocks`` message; the planner keeps its
    own copy, so the caller may reuse its lists or tensors afterwards. ``plan`` returns the
    same ``TransferPlan`` object for every layer of equal geometry in a group, and a
    freshly computed one otherwise; at most ``max_plans`` plans are kept (oldest
    dropped first). Errors are those of ``describe_layer`` and ``plan_transfer``,
    raised on every call for the offending layer (nothing failed is cached).
    With ``heads`` every layer's local blocks land in that slice of the peer's heads
    (``plan_transfer``'s ``heads``). Not thread-safe: use one planner per thread, as
    transfers are planned on one.
    """

    def __init__(
        self,
        local_block_ids: BlockIds | Sequence[BlockIds],
        remote_block_ids: BlockIds | Sequence[BlockIds],
        remote_num_blocks: int,
        *,
        max_plans: int = 256,
        heads: HeadSlice | None = None,
    ) -> None:
        local_groups = _per_group(local_block_ids)
        remote_groups = _per_group(remote_block_ids)
        if len(local_groups) != len(remote_groups):
            raise ValueError(
                f"transfer block lists: {len(local_groups)} local KV cache groups but "
                f"{len(remote_groups)} remote ones; expected one remote list per local list"
            )
        if max_plans < 1:
            raise ValueError(f"TransferPlanner.max_plans must be >= 1, got {max_plans}")
        # Private copies: the caller may reuse its id buffers while layers are planned.
        # Ids or a count that cannot be used are kept as the problem and refused for
        # every layer planned, so that each refusal names its layer.
        self._local = [_owned(read_block_ids(ids)) for ids in local_groups]
        self._remote = [_owned(read_block_ids(ids)) for ids in remote_groups]
        count = read_block_count(remote_num_blocks)
        self._count_problem = count if isinstance(count, str) else None
        self.remote_num_blocks = remote_num_blocks if isinstance(count, str) else count
        self._max_plans = max_plans
        self.heads = heads
        self._plans: dict[tuple[Hashable, ...], TransferPlan] = {}
        self.hits = 0
        self.misses = 0

    @property
    def num_groups(self) -> int:
        return len(self._local)

    def plan(
        self, layer_name: str, tensor: torch.Tensor, kv_format: LayerKVFormat, group: int = 0
    ) -> TransferPlan:
        """The merged plan for ``layer_name``'s cache ``tensor`` in KV cache ``group``."""
        key = (
            group,
            geometry_key(tensor, kv_format),
            self._count_problem or self.remote_num_blocks,
        )
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan
        if not 0 <= group < len(self._local):
            raise ValueError(
                f"layer {layer_name!r}: KV cache group {group} is not in this transfer; "
                f"expected a group in [0, {len(self._local)})"
            )
        geometry = describe_layer(layer_name, tensor, kv_format)
        if self._count_problem is not None:
            raise block_count_error(geometry, self._count_problem)
        local, remote = self._local[group], self._remote[group]
        if isinstance(local, str):
            raise block_ids_error(geometry, "local", local, geometry.num_blocks)
        if isinstance(remote, str):
            raise block_ids_error(geometry, "remote", remote, self.remote_num_blocks)
        plan = plan_transfer(geometry, local, remote, self.remote_num_blocks, heads=self.heads)
        if len(self._plans) >= self._max_plans:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        self.misses += 1
        return plan
