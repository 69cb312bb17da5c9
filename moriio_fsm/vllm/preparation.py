"""P, WRITE: a transfer's plans and engine sessions made as soon as D's blocks are known.

Rules: this runs before or during P's forward (on the forward, I/O or handshake thread), so
posting after the forward is only the posts. It is best effort: whatever fails here fails
again, and is reported, when the layer is posted. A transfer is prepared once per block
list, and never after it ended or the worker closed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..logs import get_logger
from .context import HandlerContext
from .directory import TransferInfo
from .peers import PeerLink

log = get_logger("moriio_fsm.vllm")


class WritePreparation:
    """Prepares the writes of the transfers in ``parts.directory`` with its engine and cache."""

    def __init__(self, parts: HandlerContext, closed: Callable[[], bool]):
        self._parts = parts
        self._closed = closed
        self._lock = threading.Lock()

    def prepare(self, transfer_id: str, remote_ids) -> None:
        """D's blocks ``remote_ids`` are known: make the plans and sessions now, or once the
        link to D is up."""
        info = self._parts.directory.get(transfer_id)
        remote_ids = tuple(remote_ids)
        if info is None or self._parts.cache is None or info.link is None or not remote_ids:
            return
        link = info.link
        with self._lock:  # several threads may learn of one allocation: prepare once
            if info.prepared_for == remote_ids:
                return
            info.prepared_for = remote_ids
        if not link.done():
            link.add_done_callback(lambda _: self._prepared(transfer_id, info, link, remote_ids))
            return
        self._prepared(transfer_id, info, link, remote_ids)

    def _prepared(
        self,
        transfer_id: str,
        info: TransferInfo,
        link: Future[PeerLink],
        remote_ids: tuple[int, ...],
    ) -> None:
        """Make every layer's plan and session for ``remote_ids`` once ``link`` is up, unless
        the transfer ended."""
        if self._closed() or self._parts.directory.get(transfer_id) is not info:
            return  # ended meanwhile: nothing will be posted
        try:
            engine, cache = self._parts.engine, self._parts.kv_cache()
            if link.cancelled() or link.exception() is not None:
                return
            local_ids = info.local_ids_for(remote_ids)
            peer = link.result()
            for layer in range(len(cache.names)):
                cache.plan(local_ids, remote_ids, peer.num_blocks, layer, heads=peer.heads)
                info.session(engine, cache, layer)
        except Exception as exc:
            log.debug("vllm.prepare_writes_failed", transfer_id=transfer_id, error=str(exc))
