"""P, WRITE mode: a D that allocated for a transfer id this P refused as used hears so at once.

Rules: P's scheduler refuses a request whose transfer id an earlier, finished request used,
and no machine ever takes that id again here; without an answer the D that allocated for it
would wait for its own timeouts. Whichever comes first, the refusal (from the step's
metadata) or D's allocation that no machine took, is kept until the other arrives; then D is
told ``write_failed`` (no write of P's was ever posted, so ``writes_stopped``). Only ids
refused as finished are answered: an id a live request holds may still be that request's.
Both records are bounded, oldest first out; the forward and I/O threads share them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from ..adapters.zmq import WriteFailed
from .params import PeerAddress
from .topology import notify_endpoint

#: What D hears: the reason names the cause, in the codec's printable short form.
REASON = "transfer_id_used"


class ReusedIdReplies:
    """Pairs refused transfer ids with the allocations D sent for them, and answers D."""

    def __init__(
        self,
        send: Callable[[tuple[str, int], object], None],
        producer_rank: int,
        capacity: int = 4096,
    ):
        self._send = send
        self._rank = producer_rank
        self._capacity = capacity
        self._lock = threading.Lock()
        self._refused: OrderedDict[str, PeerAddress] = OrderedDict()
        self._allocations: OrderedDict[str, int] = OrderedDict()  # transfer id -> D's TP rank

    def refused(self, transfer_id: str, peer: PeerAddress) -> None:
        """P's scheduler refused ``transfer_id`` (used before) for a request naming ``peer``."""
        with self._lock:
            rank = self._allocations.pop(transfer_id, None)
            if rank is None:
                _keep(self._refused, transfer_id, peer, self._capacity)
                return
        self._answer(transfer_id, peer, rank)

    def unanswered_allocation(self, transfer_id: str, decode_rank: int) -> None:
        """D's ``remote_blocks`` for ``transfer_id`` reached no machine here."""
        with self._lock:
            peer = self._refused.pop(transfer_id, None)
            if peer is None:
                _keep(self._allocations, transfer_id, max(decode_rank, 0), self._capacity)
                return
        self._answer(transfer_id, peer, max(decode_rank, 0))

    def _answer(self, transfer_id: str, peer: PeerAddress, decode_rank: int) -> None:
        self._send(
            notify_endpoint(peer, decode_rank),
            WriteFailed(transfer_id, reason=REASON, writes_stopped=True, producer_rank=self._rank),
        )


def _keep(record: OrderedDict, key: str, value, capacity: int) -> None:
    record[key] = value
    record.move_to_end(key)
    while len(record) > capacity:
        record.popitem(last=False)
