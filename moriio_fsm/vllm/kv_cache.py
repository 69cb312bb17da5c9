"""This worker's KV cache as the transfer engine sees it: layers, regions, memory, format.

Built once from the tensors vLLM passes to ``register_kv_caches``: every layer's geometry
is read off its tensor (a layout the planner cannot read is refused here, naming the
layer), each layer's region is registered with the engine, and the handshake reply and
the format description a peer must match are derived from the same facts.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from ..adapters.zmq import AgentMetadata, HandshakeReply
from ..layout import (
    HeadSlice,
    KVCacheSummary,
    LayerKVFormat,
    TransferPlanner,
    check_compatible,
    registration_regions,
)


class LocalKvCache:
    """Layer names in vLLM's order, their tensors, formats and registered memory."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        kv_format: LayerKVFormat,
        *,
        attention_backend: str = "",
    ):
        if not kv_caches:
            raise ValueError("register_kv_caches: vLLM passed no KV cache tensors")
        self.names: list[str] = list(kv_caches)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.tensors = dict(kv_caches)
        self.kv_format = kv_format
        self.regions = registration_regions(self.tensors, kv_format)
        geometries = [region.geometry for region in self.regions.values()]
        self.num_blocks = min(g.num_blocks for g in geometries)
        first = geometries[0]
        self.attention_backend = attention_backend
        self.summary = KVCacheSummary.of(first)
        for geometry in geometries[1:]:
            # One format for every layer: a peer checks it once, at the handshake.
            check_compatible(
                self.summary, KVCacheSummary.of(geometry), layer_name=geometry.layer_name
            )
        self.memory: dict[str, Any] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._planners: dict[tuple, TransferPlanner] = {}
        self._plan_lock = threading.Lock()

    def register(self, engine: Any) -> None:
        """Register every layer's region with ``engine`` (the views stay referenced)."""
        for name in self.names:
            view = self.regions[name].byte_view(self.tensors[name])
            self._views[name] = view
            self.memory[name] = engine.register_torch_tensor(view)

    def deregister(self, engine: Any) -> None:
        for name, memory in list(self.memory.items()):
            try:
                engine.deregister_memory(memory)
            finally:
                del self.memory[name]
        self._views.clear()

    def handshake_reply(self, engine: Any, engine_id: str) -> HandshakeReply:
        first = self.regions[self.names[0]].geometry
        metadata = AgentMetadata(
            engine_id=engine_id,
            agent_metadata=engine.get_engine_desc().pack(),
            kv_caches_base_addr=tuple(self.tensors[n].data_ptr() for n in self.names),
            num_blocks=self.num_blocks,
            block_len=first.piece_elements * first.element_size,
            attn_backend_name=self.attention_backend or "unknown",
            kv_format=self.summary.to_wire(),
        )
        return HandshakeReply(metadata, {n: (self.memory[n].pack(),) for n in self.names})

    def plan(
        self,
        local_ids: tuple[int, ...],
        remote_ids: tuple[int, ...],
        remote_num_blocks: int,
        layer: int,
        *,
        heads: HeadSlice | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """The (local offsets, remote offsets, sizes) lists that move ``layer``'s blocks
        (into slice ``heads`` of the peer's heads when given).

        Planners are cached by block lists and slice (all layers of a transfer share one)
        and used under a lock: posts come from the forward thread and the I/O thread.
        """
        key = (local_ids, remote_ids, remote_num_blocks, heads)
        name = self.names[layer]
        with self._plan_lock:
            planner = self._planners.get(key)
            if planner is None:
                if len(self._planners) >= 512:
                    self._planners.pop(next(iter(self._planners)))
                planner = self._planners[key] = TransferPlanner(
                    list(local_ids), list(remote_ids), remote_num_blocks, heads=heads
                )
            return planner.plan(name, self.tensors[name], self.kv_format).lists
