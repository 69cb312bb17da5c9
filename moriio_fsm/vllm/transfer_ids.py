"""Which transfer ids an engine's requests hold, so that one id never drives two requests.

Rules: a transfer id belongs to at most one live request of the engine; once that request
finishes the id stays used for a long while (the last ``remember`` ids), so a late or
replayed request with it is refused instead of meeting a finished transfer. Memory is
bounded: live claims by the requests vLLM holds, used ids by ``remember`` (kept as hashes).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

#: Ids remembered after their request finished. A worker's table remembers 65,536 ended
#: transfers; this is more, so an id the workers still know is always refused here first.
REMEMBERED_IDS = 1 << 17
#: Who holds an id whose request finished (what ``claim`` and ``holder`` say then).
USED_BEFORE = "a request that already finished"


class TransferIdLedger:
    """Claims of transfer ids by request ids, and the ids used lately."""

    def __init__(self, remember: int = REMEMBERED_IDS):
        self._owner: dict[str, str] = {}  # transfer id -> the live request holding it
        self._used: dict[int, None] = {}  # hashes of ids whose request finished, oldest first
        self._remember = remember

    def claim(self, transfer_id: str, request_id: str) -> str | None:
        """Give ``transfer_id`` to ``request_id``. None when it is (now) that request's;
        otherwise who holds it, for the refusal's message."""
        owner = self._owner.get(transfer_id)
        if owner == request_id:
            return None
        if owner is not None:
            return f"live request {owner!r}"
        if hash(transfer_id) in self._used:
            return USED_BEFORE
        self._owner[transfer_id] = request_id
        return None

    def holder(self, transfer_id: str, request_id: str) -> str | None:
        """Who other than ``request_id`` holds or held ``transfer_id`` (None: no one)."""
        owner = self._owner.get(transfer_id)
        if owner is not None:
            return None if owner == request_id else f"live request {owner!r}"
        return USED_BEFORE if hash(transfer_id) in self._used else None

    def finish(self, transfer_id: str, request_id: str) -> None:
        """``request_id`` finished: its id is used from now on (whether it was claimed or not)."""
        if self._owner.get(transfer_id) == request_id:
            del self._owner[transfer_id]
        used = self._used
        used[hash(transfer_id)] = None
        if len(used) > self._remember:
            del used[next(iter(used))]

    def __len__(self) -> int:
        return len(self._owner)


def prompt_digest(token_ids: Sequence[int] | None) -> str:
    """A short fingerprint of a prompt's tokens: P and D compare them before P's bytes land
    in D's blocks, so that KV never goes to a request for another prompt. "" when the
    prompt has no token ids (prompt embeddings)."""
    if not token_ids:
        return ""
    try:
        packed = array("q", token_ids).tobytes()
    except (OverflowError, TypeError):
        return ""  # not token ids this engine could have: nothing to compare
    return hashlib.blake2b(packed, digest_size=8).hexdigest()
