"""P, WRITE mode: a release from D for a transfer that already ended here gets P's verdict again.

Rules: D frees its blocks only once every writer confirmed its writes stopped, and repeats its
release until then; a verdict lost on the way (or a release that crossed it) would otherwise
leave D's blocks in quarantine for good. The machine answers while the transfer lives; once
it ended, its final state says what P can still promise: every final state but an anomaly
(quarantined) means no write of P's can land any more. This record keeps, per ended
transfer, where its D listens and that promise; it is bounded, oldest first out, and shared
by the forward and I/O threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from ..adapters.zmq import WriteFailed
from .params import PeerAddress
from .topology import notify_endpoint

#: What D hears: the transfer ended here before D's release arrived.
REASON = "ended"


class EndedVerdicts:
    """Remembers P's ended WRITE transfers and answers D's late releases for them."""

    def __init__(
        self,
        send: Callable[[tuple[str, int], object], None],
        producer_rank: int,
        capacity: int = 1 << 16,
    ):
        self._send = send
        self._rank = producer_rank
        self._capacity = capacity
        self._lock = threading.Lock()
        self._ended: OrderedDict[str, tuple[PeerAddress, bool]] = OrderedDict()

    def ended(self, transfer_id: str, peer: PeerAddress | None, writes_stopped: bool) -> None:
        """The transfer reached a final state; ``peer`` is its D (None: it never had one)."""
        if peer is None:
            return
        with self._lock:
            self._ended[transfer_id] = (peer, writes_stopped)
            self._ended.move_to_end(transfer_id)
            while len(self._ended) > self._capacity:
                self._ended.popitem(last=False)

    def answer_release(self, transfer_id: str, consumer_rank: int) -> bool:
        """Tell the releasing D rank P's verdict again; False when the transfer is not here."""
        with self._lock:
            known = self._ended.get(transfer_id)
        if known is None:
            return False
        peer, writes_stopped = known
        self._send(
            notify_endpoint(peer, max(consumer_rank, 0)),
            WriteFailed(
                transfer_id, reason=REASON, writes_stopped=writes_stopped, producer_rank=self._rank
            ),
        )
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._ended)
