"""Who a transfer is for and where its bytes go: the addressing facts effect handlers need.

The machines hold every lifecycle fact; this directory holds only identity (vLLM's
request id, the local block ids, the peer's address) so that an effect naming a
transfer id can be carried out. An entry lives from the transfer's start until its
machine reaches a final state, and the directory is bounded.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .params import PeerAddress

if TYPE_CHECKING:
    from .peers import PeerLink


@dataclass
class TransferInfo:
    """One transfer as this worker knows it."""

    request_id: str
    block_ids: tuple[int, ...]
    peer: PeerAddress | None
    remote_block_ids: tuple[int, ...] = ()
    #: READ P: where each D rank wants its lease grants (host, port), from its heartbeats.
    reply_to: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: The peer rank's link (a future of ``PeerLink``), once a handshake was asked for.
    link: Future[PeerLink] | None = None
    #: This transfer's engine sessions by layer, so its teardown stops only its bytes.
    sessions: dict[int, Any] = field(default_factory=dict)
    #: P, WRITE: D's block ids whose writes were prepared (or wait for the link to be), once.
    prepared_for: tuple[int, ...] | None = None
    #: D, WRITE: the prompt's fingerprint, sent to P with the block ids ("": unknown).
    prompt_digest: str = ""

    def local_ids_for(self, remote_ids: tuple[int, ...]) -> tuple[int, ...]:
        """P's blocks that go to D's ``remote_ids``: the prompt's tail, since D may hold a
        prefix of it already (prefix cache)."""
        if len(remote_ids) > len(self.block_ids):
            raise ValueError(
                f"D offers {len(remote_ids)} blocks, P's prompt has {len(self.block_ids)}"
            )
        return self.block_ids[len(self.block_ids) - len(remote_ids) :]

    def session(self, engine, cache, layer: int):
        session = self.sessions.get(layer)
        if session is None:
            if self.link is None:
                raise LookupError(f"request {self.request_id!r}: no link to the peer was asked for")
            name = cache.names[layer]
            made = self.link.result().new_session(engine, name, cache.memory[name])
            # The I/O thread prepares sessions while the forward thread may post: the first
            # one in wins, so a teardown always finds the session that carried the bytes.
            session = self.sessions.setdefault(layer, made)
        return session


class TransferDirectory:
    """Transfer id -> ``TransferInfo``; thread-safe; refuses growth beyond ``max_entries``."""

    def __init__(self, max_entries: int = 1 << 16):
        self._lock = threading.Lock()
        self._entries: dict[str, TransferInfo] = {}
        self._max = max_entries
        self.refused = 0

    def add(self, transfer_id: str, info: TransferInfo) -> bool:
        """Keep ``info`` for ``transfer_id``; False (counted) when the directory is full or
        the id already names another transfer, whose entry is never replaced."""
        with self._lock:
            if transfer_id in self._entries or len(self._entries) >= self._max:
                self.refused += 1
                return False
            self._entries[transfer_id] = info
            return True

    def get(self, transfer_id: str) -> TransferInfo | None:
        return self._entries.get(transfer_id)

    def drop(self, transfer_id: str) -> None:
        with self._lock:
            self._entries.pop(transfer_id, None)

    def __len__(self) -> int:
        return len(self._entries)
