"""TransferTable: creates, finds, dispatches to and retires transfers. Sans-I/O.

Rules of this file:
- ``dispatch(event)`` returns ``Result(outcome, state, effects, hops)``; it performs no
  I/O, reads no clock (time comes in the event) and starts no thread.
- Only a local event declared ``creates`` starts a transfer. A peer's message for an
  unknown transfer waits in a bounded, time-limited buffer and is applied when the
  local side creates the transfer; it never creates one itself. A peer's message whose
  payload does not match the spec's declared fields is REJECTED before anything else.
- A transfer that reached a final state is retired and remembered in a bounded
  per-shard record of ended ids: events for it are LATE. Because peers cannot create
  transfers, even an id that fell out of that record can never come back to life.
- Transfers live in shards, each with its own lock, held only while one pure
  transition runs (and the recorder, which must be quick); callers execute the
  returned effects with no lock held.
- Timers live in one deadline heap. A timer is armed on entry into its states and
  (re)armed by an applied ``restart_on`` event while the transfer is in them; firing
  or leaving its states clears it. ``advance(now)`` fires what is due; a deadline that
  moved later since it was pushed is re-pushed, not fired.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, Callable, Sequence

import msgspec

from ..lang.model import PAYLOAD_TYPES
from .codegen import generate_steps
from .compiled import CompiledMachine
from .events import Effect, Event, Outcome

_APPLIED = Outcome.APPLIED
_DUPLICATE = Outcome.DUPLICATE
_IGNORED = Outcome.IGNORED
_REJECTED = Outcome.REJECTED
_NO_EFFECTS: tuple = ()



class Result(msgspec.Struct, frozen=True, gc=False):
    """What one dispatch did: the outcome, the transfer's state after it, the effects.

    ``state`` is None when no transfer exists for the event (unknown, buffered,
    dropped, rejected before creation). ``hops`` lists the ``(from, to)`` state
    changes in order, eventless follow-ups included, or is None when the state did not
    change. Unpacks as ``outcome, state, effects``.
    """

    outcome: Outcome
    state: str | None
    effects: Sequence[Effect]
    hops: tuple[tuple[str, str], ...] | None = None

    def __iter__(self):
        return iter((self.outcome, self.state, self.effects))


class _Shard:
    __slots__ = ("lock", "live", "ended", "pending", "pending_count", "counts")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[str, Any] = {}
        self.ended: dict[str, str] = {}          # insertion-ordered: oldest first
        self.pending: dict[str, list[Event]] = {}
        self.pending_count = 0
        self.counts = [0] * len(Outcome)         # indexed by Outcome.index


Recorder = Callable[[Event, Result], None]


class TransferTable:
    """All live transfers of one machine kind, and the rules for unknown and ended ones.

    ``machine`` is a ``CompiledMachine`` (or the reference ``TransitionsMachine``).
    ``check_invariants`` evaluates every spec invariant after every step and raises
    ``InvariantViolation`` on the first that fails (for tests and debugging).
    ``recorder(event, result)`` is called once per dispatched or fired event, under the
    transfer's shard lock, so per transfer it sees events in the order applied; it must
    be quick and must not dispatch.
    """

    def __init__(self, machine: CompiledMachine, *, shards: int = 16,
                 ended_capacity: int = 65536, pending_capacity: int = 4096,
                 pending_per_transfer: int = 8, pending_ttl_s: float = 30.0,
                 check_invariants: bool = False, recorder: Recorder | None = None):
        if shards < 1 or shards & (shards - 1):
            raise ValueError(f"shards must be a power of two >= 1, got {shards}")
        for name, value in (("ended_capacity", ended_capacity), ("pending_capacity", pending_capacity),
                            ("pending_per_transfer", pending_per_transfer)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be > 0, got {pending_ttl_s}")
        self.machine = machine
        self.spec = spec = machine.spec
        self._shards = tuple(_Shard() for _ in range(shards))
        self._mask = shards - 1
        self._ended_cap = max(1, ended_capacity // shards)
        self._pending_cap = max(1, pending_capacity // shards)
        self._pending_per_transfer = pending_per_transfer
        self._pending_ttl = pending_ttl_s
        self._check = check_invariants
        self.recorder = recorder
        self._creators = frozenset(n for n, e in spec.events.items() if e.creates)
        self._remote_payloads = {
            n: tuple((field, PAYLOAD_TYPES[type_name]) for field, type_name in e.payload.items())
            for n, e in spec.events.items() if e.origin == "remote"}
        self._final = machine.final
        self._eventless = machine.eventless
        config = machine.record_class.config
        timers = list(spec.timers.values())
        self._timer_names = tuple(t.name for t in timers)
        self._timer_event = {t.event: i for i, t in enumerate(timers)}
        self._timer_event_names = tuple(t.event for t in timers)
        self._timer_duration = tuple(float(config[t.duration_key]) for t in timers)
        self._timer_states = tuple(frozenset(t.states) for t in timers)
        restart: dict[str, tuple[int, ...]] = {}
        for i, t in enumerate(timers):
            for kind in t.restart_on:
                restart[kind] = restart.get(kind, ()) + (i,)
        self._restart = restart
        # Creating, timer and peer events take the general path (creation, stale-timer
        # and payload checks); everything else may run a generated step.
        self._special = self._creators | frozenset(self._timer_event) | frozenset(self._remote_payloads)
        self._heap: list[tuple[float, int, str, int]] = []
        self._heap_lock = threading.Lock()
        self._seq = itertools.count()
        self._compact_at = 4096
        # The compiled engine runs generated per-(state, event) steps; the reference
        # engine, and any table checking invariants, always take the general path.
        self._steps: dict[str, dict] = {state: {} for state in spec.states}
        if type(machine) is CompiledMachine and not check_invariants:
            restarts = {kind: tuple((i, self._timer_duration[i], self._timer_states[i])
                                    for i in indices)
                        for kind, indices in self._restart.items()}
            self._steps = generate_steps(machine, Result, self._finish_generated, self._arm,
                                         restarts, self._special, _NO_EFFECTS)

    # -- public API -------------------------------------------------------------------

    def dispatch(self, ev: Event) -> Result:
        """Apply one event. Never raises for late, duplicate, unknown, malformed-peer
        or unexpected events: those are outcomes. Raises ``TransitionError`` only for a
        bug in a binding and ``InvariantViolation`` only when invariant checking is on."""
        shard = self._shards[hash(ev.transfer_id) & self._mask]
        # acquire/release rather than 'with': half the cost on this hot path, and the
        # try/finally still releases on any exception.
        shard.lock.acquire()
        try:
            t = shard.live.get(ev.transfer_id)
            if t is None:
                result = self._dispatch_absent(shard, ev)
                shard.counts[result.outcome.index] += 1
            else:
                step = self._steps[t.state].get(ev.kind)
                if step is not None:
                    try:
                        result = step(shard, t, ev)   # counts its own outcome
                    except Exception as exc:
                        raise self.machine.binding_error(t, ev, exc) from exc
                else:
                    result = self._dispatch_live(shard, t, ev)
                    shard.counts[result.outcome.index] += 1
            if self.recorder is not None:
                self.recorder(ev, result)
        finally:
            shard.lock.release()
        return result

    def advance(self, now: float) -> list[tuple[Event, Result]]:
        """Fire every timer whose deadline is <= ``now``, earliest first; return the
        fired events with their results. Deadlines pushed back by progress are
        re-queued, not fired. Checking and firing happen under one shard lock, so a
        concurrent restart either lands before (and the timer is re-queued) or after."""
        fired = []
        while True:
            with self._heap_lock:
                if not self._heap or self._heap[0][0] > now:
                    return fired
                deadline, _, transfer_id, index = heapq.heappop(self._heap)
            shard = self._shards[hash(transfer_id) & self._mask]
            shard.lock.acquire()
            try:
                t = shard.live.get(transfer_id)
                current = t.deadlines[index] if t is not None else None
                if current is None:
                    continue                                  # disarmed or retired
                if current > deadline:
                    self._push(current, transfer_id, index)   # restarted since pushed
                    continue
                ev = Event(transfer_id, self._timer_event_names[index], current,
                           {"timer": self._timer_names[index]})
                result = self._dispatch_live(shard, t, ev)
                shard.counts[result.outcome.index] += 1
                if self.recorder is not None:
                    self.recorder(ev, result)
            finally:
                shard.lock.release()
            fired.append((ev, result))

    def next_deadline(self) -> float | None:
        """The earliest pending deadline (possibly stale), for a driver's sleep."""
        with self._heap_lock:
            return self._heap[0][0] if self._heap else None

    def get(self, transfer_id: str):
        """The live record of ``transfer_id`` or None. Read it only for inspection."""
        return self._shards[hash(transfer_id) & self._mask].live.get(transfer_id)

    def state_of(self, transfer_id: str) -> str | None:
        """The live state, the final state if remembered as ended, else None."""
        shard = self._shards[hash(transfer_id) & self._mask]
        with shard.lock:
            t = shard.live.get(transfer_id)
            if t is not None:
                return t.state
            return shard.ended.get(transfer_id)

    def __len__(self) -> int:
        return sum(len(s.live) for s in self._shards)

    def stats(self) -> dict[str, Any]:
        """Counters of every outcome plus live, ended, pending and timer sizes."""
        counts = [0] * len(Outcome)
        for s in self._shards:
            with s.lock:
                for index, n in enumerate(s.counts):
                    counts[index] += n
        return {
            "outcomes": {o.value: counts[o.index] for o in Outcome},
            "live": len(self),
            "ended_remembered": sum(len(s.ended) for s in self._shards),
            "pending_events": sum(s.pending_count for s in self._shards),
            "timer_entries": len(self._heap),
        }

    # -- internals (shard lock held) ---------------------------------------------------

    def _payload_ok(self, ev: Event) -> bool:
        """True unless ``ev`` is a peer's event missing a declared field or mistyped."""
        fields = self._remote_payloads.get(ev.kind)
        if not fields:
            return True
        data = ev.data
        for name, types in fields:
            value = data.get(name)
            if value is None or not isinstance(value, types) or (
                    isinstance(value, bool) and bool not in types):
                return False
        return True

    def _dispatch_absent(self, shard: _Shard, ev: Event) -> Result:
        tid = ev.transfer_id
        if tid in shard.ended:
            return Result(Outcome.LATE, shard.ended[tid], _NO_EFFECTS)
        if ev.kind in self._creators:
            return self._create(shard, ev)
        if ev.kind in self._remote_payloads:
            if not self._payload_ok(ev):
                return Result(_REJECTED, None, _NO_EFFECTS)
            return self._buffer(shard, ev)
        return Result(Outcome.UNKNOWN, None, _NO_EFFECTS)

    def _create(self, shard: _Shard, ev: Event) -> Result:
        t = self.machine.record_class(ev.transfer_id)
        out: list[Effect] = []
        outcome, hops = self.machine.step(t, ev, out)
        if outcome is not _APPLIED:
            # The spec refused the creating event itself (a guard on its payload):
            # nothing is created, armed or remembered.
            return Result(_REJECTED, None, out or _NO_EFFECTS)
        for index, armed_in in enumerate(self._timer_states):
            if self.spec.initial in armed_in:
                self._arm(t, index, ev.time)
        self._after_step(t, ev, _APPLIED, hops)
        all_hops = list(hops or ())
        shard.live[ev.transfer_id] = t
        for held in self._take_pending(shard, ev):
            if t.state in self._final:
                shard.counts[Outcome.LATE.index] += 1
                continue
            held_result = self._dispatch_live(shard, t, held, retire=False)
            shard.counts[held_result.outcome.index] += 1
            out.extend(held_result.effects)
            all_hops.extend(held_result.hops or ())
        if t.state in self._final:
            self._retire(shard, t)
        return Result(Outcome.CREATED, t.state, out or _NO_EFFECTS,
                      tuple(all_hops) if all_hops else None)

    def _dispatch_live(self, shard: _Shard, t, ev: Event, retire: bool = True) -> Result:
        kind = ev.kind
        if kind in self._creators:
            return Result(_DUPLICATE, t.state, _NO_EFFECTS)
        if not self._payload_ok(ev):
            return Result(_REJECTED, t.state, _NO_EFFECTS)
        timer = self._timer_event.get(kind)
        if timer is not None:
            deadline = t.deadlines[timer]
            if deadline is None or deadline > ev.time:
                return Result(_IGNORED, t.state, _NO_EFFECTS)   # stale or early timer
            t.deadlines[timer] = None
        out: list[Effect] = []
        outcome, hops = self.machine.step(t, ev, out)
        return self._finish(shard, t, ev, outcome, hops, out, retire)

    def _finish_generated(self, shard: _Shard, t, ev: Event, outcome: Outcome,
                          dest: str | None, out) -> Result:
        """Follow-up of a generated step whose row changes state or may enable an
        eventless transition; counts the outcome like every generated step does."""
        shard.counts[outcome.index] += 1
        hops = None
        if dest is not None and dest != t.state:
            hops = [(t.state, dest)]
            t.state = dest
        if outcome is _APPLIED and self._eventless[t.state]:
            if out is _NO_EFFECTS:
                out = []
            hops = self.machine._settle(t, ev, out, hops)
        return self._finish(shard, t, ev, outcome, hops, out)

    def _finish(self, shard: _Shard, t, ev: Event, outcome: Outcome, hops, out,
                retire: bool = True) -> Result:
        if outcome is _APPLIED:
            self._after_step(t, ev, outcome, hops)
            if retire and hops is not None and t.state in self._final:
                self._retire(shard, t)
        elif self._check:
            self.machine.check_invariants(t, ev)
        return Result(outcome, t.state, out or _NO_EFFECTS, tuple(hops) if hops else None)

    def _after_step(self, t, ev: Event, outcome: Outcome, hops) -> None:
        deadlines = t.deadlines
        if hops:
            for src, dst in hops:
                for index, armed_in in enumerate(self._timer_states):
                    if dst in armed_in:
                        if src not in armed_in or deadlines[index] is None:
                            self._arm(t, index, ev.time)
                    else:
                        deadlines[index] = None
        if outcome is _APPLIED:
            for index in self._restart.get(ev.kind, ()):
                if t.state in self._timer_states[index]:
                    if deadlines[index] is None:
                        self._arm(t, index, ev.time)
                    else:
                        deadlines[index] = ev.time + self._timer_duration[index]
        if self._check:
            self.machine.check_invariants(t, ev)

    def _arm(self, t, index: int, now: float) -> None:
        deadline = now + self._timer_duration[index]
        t.deadlines[index] = deadline
        self._push(deadline, t.transfer_id, index)

    def _push(self, deadline: float, transfer_id: str, index: int) -> None:
        with self._heap_lock:
            heapq.heappush(self._heap, (deadline, next(self._seq), transfer_id, index))
            if len(self._heap) > self._compact_at:
                self._compact_heap()

    def _compact_heap(self) -> None:
        """Drop entries of retired transfers and disarmed timers (heap lock held).

        Retired transfers leave their entries behind until the deadline; compaction
        keeps the heap proportional to armed timers. Reading another shard's dict
        without its lock is safe under the GIL: an entry is only dropped when its
        transfer is gone (it never returns) or its slot is empty (a re-arm pushes a
        new entry).
        """
        mask = self._mask
        shards = self._shards
        kept = []
        for entry in self._heap:
            t = shards[hash(entry[2]) & mask].live.get(entry[2])
            if t is not None and t.deadlines[entry[3]] is not None:
                kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept
        self._compact_at = max(4096, 2 * len(kept))

    def _retire(self, shard: _Shard, t) -> None:
        del shard.live[t.transfer_id]
        if t.deadlines:
            for index in range(len(t.deadlines)):
                t.deadlines[index] = None
        ended = shard.ended
        ended[t.transfer_id] = t.state
        if len(ended) > self._ended_cap:
            del ended[next(iter(ended))]

    def _buffer(self, shard: _Shard, ev: Event) -> Result:
        held = shard.pending.get(ev.transfer_id)
        if held is not None and len(held) >= self._pending_per_transfer:
            return Result(Outcome.DROPPED, None, _NO_EFFECTS)
        if shard.pending_count >= self._pending_cap:
            self._expire_pending(shard, ev.time)
            if shard.pending_count >= self._pending_cap:
                return Result(Outcome.DROPPED, None, _NO_EFFECTS)
            held = shard.pending.get(ev.transfer_id)
        if held is None:
            held = shard.pending[ev.transfer_id] = []
        held.append(ev)
        shard.pending_count += 1
        return Result(Outcome.BUFFERED, None, _NO_EFFECTS)

    def _expire_pending(self, shard: _Shard, now: float) -> None:
        """Drop every held fact older than the TTL (runs only when the buffer is full,
        so its cost is bounded by the buffer's size)."""
        horizon = now - self._pending_ttl
        for tid in list(shard.pending):
            held = shard.pending[tid]
            fresh = [h for h in held if h.time >= horizon]
            dropped = len(held) - len(fresh)
            if not dropped:
                continue
            shard.pending_count -= dropped
            shard.counts[Outcome.DROPPED.index] += dropped
            if fresh:
                shard.pending[tid] = fresh
            else:
                del shard.pending[tid]

    def _take_pending(self, shard: _Shard, ev: Event) -> list[Event]:
        held = shard.pending.pop(ev.transfer_id, None)
        if not held:
            return []
        shard.pending_count -= len(held)
        horizon = ev.time - self._pending_ttl
        fresh = [h for h in held if h.time >= horizon]
        shard.counts[Outcome.DROPPED.index] += len(held) - len(fresh)
        return fresh
