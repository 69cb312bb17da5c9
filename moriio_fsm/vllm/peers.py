"""Links to peer engines: one handshake per peer rank, then engine sessions per transfer.

A link starts with the peer's handshake reply (asked on the transport's I/O thread, never
on the forward thread), is refused when the two KV caches differ (but for the exact head
count a head-sliced link asks for), and registers the peer's engine and layer memory with
the local engine. Links are cached by handshake address and head slice; a failed one is
dropped so the next transfer asks again. No lifecycle rule
lives here: a transfer only waits for its link through the machines' own events.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..adapters.zmq import HandshakeReply
from ..errors import MoriioFsmError
from ..layout import HeadSlice, KVCacheSummary, KVLayoutError, check_compatible
from ..logs import get_logger

log = get_logger("moriio_fsm.vllm")

#: A link's cache key: the peer rank's handshake address and the head slice asked for.
_LinkKey = tuple[tuple[str, int], HeadSlice | None]


class PeerMismatchError(MoriioFsmError, ValueError):
    """The peer's KV cache cannot exchange blocks with ours; the message names both values."""


@dataclass
class PeerLink:
    """A peer rank's engine and layer memory, registered with the local engine."""

    address: tuple[str, int]
    engine_id: str
    num_blocks: int
    kv_format: Mapping[str, Any]
    remote_memory: dict[str, Any]
    #: Which slice of the peer's heads our blocks fill (None: whole blocks, equal heads).
    heads: HeadSlice | None = None

    def new_session(self, engine: Any, layer_name: str, local_memory: Any) -> Any:
        """A fresh engine session from our layer to the peer's.

        One per transfer and layer, so that tearing one transfer down (``kill``) never
        stops another transfer's bytes.
        """
        remote = self.remote_memory.get(layer_name)
        if remote is None:
            raise PeerMismatchError(
                f"peer {self.address[0]}:{self.address[1]} has no KV cache for layer {layer_name!r}"
            )
        session = engine.create_session(local_memory, remote)
        if session is None:
            raise PeerMismatchError(
                f"the engine refused a session to layer {layer_name!r} "
                f"of peer {self.address[0]}:{self.address[1]}"
            )
        return session


class PeerLinks:
    """Handshakes with peers through ``request`` and the links they produce, by address."""

    def __init__(
        self,
        request: Callable[[tuple[str, int]], concurrent.futures.Future],
        engine: Any,
        local: KVCacheSummary,
        layer_names: list[str],
        *,
        max_links: int = 1024,
    ):
        self._request = request
        self._engine = engine
        self._local = local
        self._layer_names = set(layer_names)
        self._max_links = max_links
        self._lock = threading.Lock()
        self._links: dict[_LinkKey, concurrent.futures.Future] = {}
        self.failures = 0

    def link(
        self, address: tuple[str, int], heads: HeadSlice | None = None
    ) -> concurrent.futures.Future[PeerLink]:
        """A future of the ``PeerLink`` to ``address``; starts the handshake if none is cached.

        With ``heads`` the peer must hold exactly ``heads.ratio`` times our heads per block.
        """
        key = (address, heads)
        with self._lock:
            future = self._links.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                return future
            if len(self._links) >= self._max_links:
                # Drop finished links first: a busy deployment meets new peers, not old ones.
                for key in [k for k, f in self._links.items() if f.done()][
                    : len(self._links) // 2 + 1
                ]:
                    del self._links[key]
            future = concurrent.futures.Future()
            self._links[key] = future
        try:
            reply = self._request(address)
        except Exception as exc:  # refused at once: untrusted, busy, closed
            self._fail(key, future, exc)
            return future
        reply.add_done_callback(lambda done: self._finish(key, future, done))
        return future

    def _finish(
        self, key: _LinkKey, future: concurrent.futures.Future, reply: concurrent.futures.Future
    ) -> None:
        try:
            address, heads = key
            future.set_result(self._register(address, heads, reply.result()))
        except Exception as exc:
            self._fail(key, future, exc)

    def _fail(self, key: _LinkKey, future: concurrent.futures.Future, exc: BaseException) -> None:
        self.failures += 1
        address = key[0]
        log.warning("vllm.handshake_failed", peer=f"{address[0]}:{address[1]}", error=str(exc))
        with self._lock:
            if self._links.get(key) is future:
                del self._links[key]
        if not future.done():
            future.set_exception(exc)

    def _register(
        self, address: tuple[str, int], heads: HeadSlice | None, reply: HandshakeReply
    ) -> PeerLink:
        meta = reply.metadata
        peer = f"peer {address[0]}:{address[1]} ({meta.engine_id})"
        if meta.kv_format is None:
            raise PeerMismatchError(
                f"{peer} did not describe its KV cache in the handshake "
                "(an older or foreign connector); refusing to exchange blocks"
            )
        try:
            remote = KVCacheSummary.from_wire(meta.kv_format)
            check_compatible(self._local, remote, head_ratio=heads.ratio if heads else 1)
        except KVLayoutError as exc:
            raise PeerMismatchError(f"{peer}: {exc}{_heads_hint(self._local, heads)}") from None
        if set(reply.layer_memory) != self._layer_names:
            missing = sorted(self._layer_names - set(reply.layer_memory))[:3]
            extra = sorted(set(reply.layer_memory) - self._layer_names)[:3]
            raise PeerMismatchError(
                f"{peer} has other KV cache layers: missing {missing}, "
                f"extra {extra}; both instances must run the same model"
            )
        engine = self._engine
        engine.register_remote_engine(engine.unpack_engine_desc(meta.agent_metadata))
        memory = {
            name: engine.unpack_memory_desc(descs[0]) for name, descs in reply.layer_memory.items()
        }
        # An engine that maps a peer's memory (shared pages) does it here, on the I/O thread,
        # rather than in the first transfer's post on the forward thread.
        for desc in memory.values():
            engine.prepare_remote_memory(desc)
        return PeerLink(address, meta.engine_id, meta.num_blocks, meta.kv_format, memory, heads)

    def close(self) -> None:
        with self._lock:
            pending = list(self._links.values())
            self._links.clear()
        for future in pending:
            future.cancel()


def _heads_hint(local: KVCacheSummary, heads: HeadSlice | None) -> str:
    """What a refusal adds about TP sizes: which head split this link expected."""
    if heads is not None:
        return (
            f" (this rank writes slice {heads.index} of {heads.ratio} of the peer rank's heads: "
            f"P's TP size is {heads.ratio} times D's)"
        )
    return (
        " (heads per rank must be equal unless P, in WRITE mode, has a TP size that is a "
        "multiple of D's; READ mode reads one P rank's whole blocks, so P's and D's TP sizes "
        "must be equal)"
        if local.num_kv_heads is not None
        else ""
    )
