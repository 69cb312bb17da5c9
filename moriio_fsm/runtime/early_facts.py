"""Peer facts that arrive before their transfer exists, held for a while and shared fairly.

Rules (the caller holds the owning shard's lock): every operation is O(1) amortized,
whatever floods in; at most ``capacity`` facts are held, at most ``per_transfer`` for one
transfer id and at most ``per_source`` from one sending peer. When a peer is at its
quota its own oldest fact makes room; when the buffer is full the oldest fact of the
peer holding the most goes. So a flood, however large, only churns the flooder's share
and never pushes out another peer's early ``remote_blocks``. Quotas are per sending host
(a peer chooses its connection identity, not its address). Facts older than ``ttl`` are
never applied.
"""

from __future__ import annotations

from collections import deque

from .events import Event


def sender_of(ev: Event) -> str:
    """The sender a fact's quota is charged to: the peer's host. A peer picks its own
    connection identity (``host#identity``), so one host could pose as many peers; it
    cannot pick its address."""
    return ev.source.partition("#")[0]


class _Held:
    __slots__ = ("event", "alive")

    def __init__(self, event: Event) -> None:
        self.event = event
        self.alive = True


class EarlyFacts:
    """A bounded, time-limited, per-peer-fair buffer of facts for unknown transfer ids."""

    def __init__(self, capacity: int, per_transfer: int, per_source: int, ttl: float):
        self.capacity = capacity
        self.per_transfer = per_transfer
        self.per_source = per_source
        self.ttl = ttl
        self._by_transfer: dict[str, list[_Held]] = {}
        self._by_source: dict[str, deque[_Held]] = {}
        self._count_of: dict[str, int] = {}  # live facts per source
        self._sources_with: dict[int, set[str]] = {}  # live count -> sources holding that many
        self._most = 0  # the largest live count of any source
        self._size = 0
        #: Entries looked at by expiry and eviction, in total: the work a flood costs,
        #: which stays proportional to the facts offered, never to the buffer's size.
        self.examined = 0

    def __len__(self) -> int:
        return self._size

    def hold(self, ev: Event) -> tuple[bool, int]:
        """Keep ``ev``; return ``(kept, evicted)``: whether it was kept and how many older
        facts were dropped to make room."""
        source = sender_of(ev)
        evicted = self._expire_front(source, ev.time)
        held = self._by_transfer.get(ev.transfer_id)
        if held is not None and len(held) >= self.per_transfer:
            # This id is full: the sender holding most of its facts gives one up, unless
            # that is the newcomer itself.
            counts: dict[str, int] = {}
            for entry in held:
                sender = sender_of(entry.event)
                counts[sender] = counts.get(sender, 0) + 1
            hog = max(counts, key=counts.__getitem__)
            if hog == source or counts[hog] <= counts.get(source, 0) + 1:
                return False, evicted
            victim = next(entry for entry in held if sender_of(entry.event) == hog)
            self._forget(victim)
            evicted += 1
        replaced = False
        if self._count_of.get(source, 0) >= self.per_source:
            # The sender is at its quota: its oldest fact makes room. Its count does not
            # change, so the buckets are left alone (a flood's every fact takes this path).
            if self._evict_oldest(source, recount=False):
                evicted += 1
                replaced = True
        elif self._size >= self.capacity:
            evicted += self._evict_oldest(next(iter(self._sources_with[self._most])))
        entry = _Held(ev)
        held = self._by_transfer.get(ev.transfer_id)  # eviction may have removed the list
        if held is None:
            self._by_transfer[ev.transfer_id] = [entry]
        else:
            held.append(entry)
        queue = self._by_source.get(source)
        if queue is None:
            queue = self._by_source[source] = deque()
        queue.append(entry)
        if not replaced:
            self._recount(source, +1)
        return True, evicted

    def take(self, transfer_id: str, now: float) -> tuple[list[Event], int]:
        """Remove the facts held for ``transfer_id``; return ``(fresh, expired)``: those
        still within the TTL in arrival order, and how many were too old to apply."""
        held = self._by_transfer.pop(transfer_id, None)
        if not held:
            return [], 0
        horizon = now - self.ttl
        fresh = []
        for entry in held:
            entry.alive = False
            self._recount(sender_of(entry.event), -1)
            if entry.event.time >= horizon:
                fresh.append(entry.event)
        for source in {sender_of(entry.event) for entry in held}:
            self._tidy(source)
        return fresh, len(held) - len(fresh)

    # -- internals ------------------------------------------------------------------------

    def _expire_front(self, source: str, now: float) -> int:
        """Drop ``source``'s facts that are past the TTL, oldest first (they sit in front)."""
        queue = self._by_source.get(source)
        dropped = 0
        horizon = now - self.ttl
        while queue and (not queue[0].alive or queue[0].event.time < horizon):
            self.examined += 1
            entry = queue.popleft()
            if entry.alive:
                self._forget(entry)
                dropped += 1
        if queue is not None and not queue:
            del self._by_source[source]
        return dropped

    def _evict_oldest(self, source: str, recount: bool = True) -> int:
        queue = self._by_source[source]
        while queue:
            self.examined += 1
            entry = queue.popleft()
            if entry.alive:
                self._forget(entry, recount)
                if not queue:
                    del self._by_source[source]
                return 1
        del self._by_source[source]
        return 0

    def _forget(self, entry: _Held, recount: bool = True) -> None:
        entry.alive = False
        tid = entry.event.transfer_id
        held = self._by_transfer.get(tid)
        if held is not None:
            if len(held) == 1:
                del self._by_transfer[tid]
            else:
                held.remove(entry)  # at most per_transfer long
        if recount:
            self._recount(sender_of(entry.event), -1)

    def _recount(self, source: str, delta: int) -> None:
        old = self._count_of.get(source, 0)
        new = old + delta
        if old:
            bucket = self._sources_with[old]
            bucket.discard(source)
            if not bucket:
                del self._sources_with[old]
        if new:
            self._count_of[source] = new
            self._sources_with.setdefault(new, set()).add(source)
        else:
            self._count_of.pop(source, None)
        self._size += delta
        if new > self._most:
            self._most = new
        while self._most and self._most not in self._sources_with:
            self._most -= 1

    def _tidy(self, source: str) -> None:
        """Drop dead entries from the front of ``source``'s queue, and rebuild the queue
        when dead entries left in its middle outnumber the live ones."""
        queue = self._by_source.get(source)
        if queue is None:
            return
        while queue and not queue[0].alive:
            queue.popleft()
        live = self._count_of.get(source, 0)
        if not queue:
            del self._by_source[source]
        elif len(queue) > 2 * live + 8:
            self.examined += len(queue)
            self._by_source[source] = deque(e for e in queue if e.alive)
