"""The NIXL engine's descriptors: an engine's agent metadata, and each registered tensor with NIXL's metadata of it.

Rules: they travel as tagged msgpack structs; unpacking takes only bytes of its own kind (``TypeError`` for
non-bytes, ``ValueError`` naming what is wrong).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ..checks import PackedDescriptor

__all__ = ["NixlEngineDesc", "NixlMemoryDesc"]

_Positive = Annotated[int, msgspec.Meta(gt=0)]


class NixlEngineDesc(PackedDescriptor, frozen=True, tag="moriio-nixl-engine"):
    """Who a NIXL engine is: its agent name (the engine key) and the agent's packed metadata."""

    key: str
    agent_metadata: (
        bytes  # NIXL's full local metadata: connection info and the memory registered so far
    )
    host: str = ""
    hostname: str = ""
    pid: int = 0


class NixlMemoryDesc(PackedDescriptor, frozen=True, tag="moriio-nixl-memory"):
    """One registered tensor: its owner, where it lives, how big it is, and NIXL's metadata for it alone."""

    engine_key: str
    mem_id: _Positive
    address: _Positive
    size: _Positive
    dtype: str
    shape: tuple[int, ...]
    # Partial agent metadata of this one region (no connection info): a peer that learned the
    # engine before this tensor was registered loads it from here.
    metadata: bytes = b""
