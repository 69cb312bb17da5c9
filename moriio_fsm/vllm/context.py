"""What an effect handler may use: the worker's parts, named one by one, never the worker.

Rules: the worker makes one ``HandlerContext`` and fills in the engine, KV cache and peer
links when vLLM registers the cache (no transfer starts before that). Handlers read the
directory, post through the engine, send through ``send`` and hand events back through
``dispatch``; they decide nothing about what happens next.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..adapters.zmq.reporting import LogLimiter
from ..layout import HeadSlice
from ..runtime.events import Event
from .directory import TransferDirectory, TransferInfo
from .kv_cache import LocalKvCache
from .metrics import TransferMetrics
from .params import PeerAddress
from .peers import PeerLink, PeerLinks
from .reports import VllmReports
from .topology import Endpoint, Topology, handshake_endpoint, notify_endpoint


@dataclass
class HandlerContext:
    """The parts of one rank that effect handlers use."""

    #: Who each live transfer is for and where its bytes go.
    directory: TransferDirectory
    #: What vLLM is told (finished sending / receiving, load errors).
    reports: VllmReports
    #: This interval's counters for vLLM (bytes moved, ...).
    metrics: TransferMetrics
    #: This rank's TP and DP ranks, and the peer ranks it pairs with.
    topology: Topology
    clock: Callable[[], float]
    #: Queue a control message to a peer; an immediate refusal raises.
    send: Callable[[Endpoint, Any], None]
    #: Hand an event to this rank's machine of a side ("send" or "receive").
    dispatch: Callable[[str, Event], list]
    #: A posted layer's completion event if the engine already finished it, else None.
    completion_of: Callable[[Any, str, int, str], Event | None]
    #: Drop the completions still awaited for a transfer whose operations were torn down.
    forget_completions: Callable[[str], int]
    #: The port this rank hears its peers on (a READ heartbeat names it for the grant).
    reply_port: Callable[[], int | None]
    #: Rate-limits the warnings about failed transfers.
    failure_log: LogLimiter
    #: From ``register_kv_caches`` on: the transfer engine, the KV cache, the peer links.
    engine: Any = None
    cache: LocalKvCache | None = None
    links: PeerLinks | None = None

    def info(self, transfer_id: str) -> TransferInfo:
        """The directory entry of ``transfer_id``; ``LookupError`` when it has none."""
        info = self.directory.get(transfer_id)
        if info is None:
            raise LookupError(f"transfer {transfer_id!r} has no addressing entry on this rank")
        return info

    def peer_of(self, info: TransferInfo) -> PeerAddress:
        """The peer ``info`` names; ``LookupError`` when its request named none."""
        if info.peer is None:
            raise LookupError(
                f"request {info.request_id!r}: the peer's address is unknown "
                "(kv_transfer_params named no remote host)"
            )
        return info.peer

    def kv_cache(self) -> LocalKvCache:
        """The registered KV cache (vLLM registers it before any transfer starts)."""
        if self.cache is None:
            raise RuntimeError(
                "no KV cache is registered yet: vLLM registers it before the first transfer"
            )
        return self.cache

    def send_to_peer(self, info: TransferInfo, peer_rank: int, message: Any) -> None:
        """Send ``message`` to rank ``peer_rank`` of the peer ``info`` names."""
        self.send(notify_endpoint(self.peer_of(info), peer_rank), message)

    def link_for(
        self, info: TransferInfo, peer_rank: int, heads: HeadSlice | None = None
    ) -> Future[PeerLink]:
        """The future ``PeerLink`` to rank ``peer_rank`` of ``info``'s peer (one handshake
        per rank; the links are made with the KV cache, before any transfer starts); with
        ``heads``, a link whose blocks hold ours as that slice of their heads."""
        if self.links is None:
            raise RuntimeError("no peer links yet: they are made when vLLM registers the KV cache")
        return self.links.link(handshake_endpoint(self.peer_of(info), peer_rank), heads)
