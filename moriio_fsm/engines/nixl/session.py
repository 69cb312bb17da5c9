"""What a NIXL engine keeps per peer, per registration and per transfer, and its session.

Rules: a session's transfers fail once its engine closed, either registration went, or its peer was withdrawn,
registered anew or broke; nothing here calls NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..base import SessionBase
from ..inflight import Posted
from .descriptors import NixlEngineDesc, NixlMemoryDesc

__all__ = ["NixlSession", "Peer", "Registration", "Transfer"]


@dataclass(eq=False)
class Peer:
    """A remote engine whose agent metadata NIXL loaded."""

    desc: NixlEngineDesc
    generation: int
    loaded: set[int] = field(default_factory=set)  # mem_ids of its memory loaded into our agent
    withdrawn: bool = False
    broken: str | None = None  # why the transport to it failed; later transfers fail at once

    def gone(self) -> str | None:
        if self.withdrawn:
            return f"remote engine {self.desc.key!r} was deregistered"
        return self.broken


@dataclass(frozen=True, slots=True)
class Registration:
    """One tensor this engine registered with NIXL."""

    desc: NixlMemoryDesc
    tensor: torch.Tensor  # held so the memory cannot be freed while NIXL may reach it
    reg_descs: Any  # NIXL's registration list, what deregistration takes


@dataclass(slots=True, eq=False)
class Transfer(Posted):
    """A posted batch and NIXL's handle on it, once started."""

    handle: Any = None
    deadline: float = 0.0
    cancel_failed: bool = False


class NixlSession(SessionBase):
    """A channel from one local registered tensor to one registered tensor of a peer (or this) engine."""

    def __init__(
        self, engine: Any, local: NixlMemoryDesc, remote: NixlMemoryDesc, peer: Peer | None
    ) -> None:
        super().__init__(engine, local, remote)
        self._peer = peer  # None: the remote memory is this engine's own

    def alive(self) -> bool:
        return self.why_dead() is None

    def why_dead(self) -> str | None:
        """Why transfers on this session fail now, or None."""
        engine = self._engine
        if engine.closed:
            return f"engine {engine.key!r} is closed"
        if not engine._holds(self.local_mem):
            return f"local memory {self.local_mem.mem_id} was deregistered"
        if self._peer is None:
            return (
                None
                if engine._holds(self.remote_mem)
                else f"memory {self.remote_mem.mem_id} of this engine was deregistered"
            )
        return self._peer.gone() or engine._peer_replaced(self._peer)
