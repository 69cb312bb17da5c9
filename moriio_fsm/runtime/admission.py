"""Which events reach a transfer's step, and what becomes of the others.

Rules (the table's, ``table.py``, for the kinds that need checks before their step):
only a local event declared ``creates`` starts a transfer, and a second one is a
duplicate; a peer's fact for an unknown transfer is held (``early_facts.py``), never
creates one, and is applied when the transfer is created; a peer's fact counts only
from a sender the transfer is bound to (else FORGED); an event for an ended transfer is
LATE. (A timer event counts only when due: ``timer_driving.py``.) ``Admission`` is the
part of ``TransferTable`` that applies them (the caller holds the shard's lock).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..lang.model import value_fits
from .early_facts import sender_of
from .errors import TransitionError
from .events import Event, Outcome, Result
from .shard import Shard

if TYPE_CHECKING:
    from ..lang.model import Spec
    from .machine import Machine
    from .timers import TimerPlan


log = logging.getLogger("moriio_fsm.runtime")

_APPLIED = Outcome.APPLIED
_REJECTED = Outcome.REJECTED
NO_EFFECTS: tuple = ()

#: A creating event's ``source`` that binds the transfer to the first peer it hears from.
FIRST_SENDER = "?"

_HELD = Result(Outcome.BUFFERED, None, NO_EFFECTS)
_DROPPED = Result(Outcome.DROPPED, None, NO_EFFECTS)
_UNKNOWN = Result(Outcome.UNKNOWN, None, NO_EFFECTS)


def bound_senders(source: Any):
    """What a creating event's ``source`` binds its transfer to: None (anyone),
    ``FIRST_SENDER``, or a frozenset of senders; ``_REJECTED`` when it is no such thing."""
    if source.__class__ is not str:
        return _REJECTED
    if not source:
        return None
    if source == FIRST_SENDER:
        return FIRST_SENDER
    return frozenset(source.split(","))


class Admission:
    """The checks before a step, as ``TransferTable`` methods (the timer events' check,
    ``_timer_step``, is ``TimerDriving``'s). They use the table's ``machine``, ``spec``,
    ``_steps``, ``_creating_steps``, ``_creators``, ``_remote_payloads``, ``_plan``,
    ``_initial_timers``, ``_final`` and ``_arm``."""

    if TYPE_CHECKING:  # what the table provides (its __init__, and TimerDriving)
        machine: Machine
        spec: Spec
        _steps: dict[str, dict[str, Any]]
        _creating_steps: dict[str, Any]
        _creators: frozenset[str]
        _remote_payloads: dict[str, tuple[tuple[str, str], ...]]
        _plan: TimerPlan
        _initial_timers: tuple[int, ...]
        _final: frozenset[str]

        def _arm(self, tx: Any, index: int, now: float) -> None: ...

        def _timer_step(
            self, index: int, step: Any, shard: Shard, tx: Any, ev: Event
        ) -> Result: ...

    # -- wrappers put in front of the steps of special kinds -----------------------------

    def _guard_special_kinds(self, steps: dict) -> dict:
        """Put a checking wrapper in front of the steps of creating, timer and peer
        events, in every state: a second create is a duplicate, a timer event counts only
        when its deadline is due, a peer's event counts only from the transfer's own peer.
        (Every step checks its event's payload types itself.) Returns the creating steps
        themselves, which ``_create`` runs."""
        initial = steps[self.spec.initial]
        creating_steps = {kind: initial.get(kind) for kind in self._creators}
        for by_kind in steps.values():
            for kind in self._creators:
                by_kind[kind] = self._duplicate_create
            for kind, index in self._plan.index_of_event.items():
                by_kind[kind] = functools.partial(self._timer_step, index, by_kind.get(kind))
            for kind in self._remote_payloads:
                by_kind[kind] = functools.partial(self._peer_step, by_kind.get(kind))
        return creating_steps

    def _peer_step(self, step, shard: Shard, tx, ev: Event) -> Result:
        """A peer's event for a live transfer: taken only from a sender the transfer is
        bound to (any sender when unbound; the first one heard when bound that way)."""
        bound = tx._senders
        if bound is not None:
            source = ev.source
            if source.__class__ is not str:
                shard.counts[_REJECTED.index] += 1
                return Result(_REJECTED, tx.state, NO_EFFECTS)
            sender = sender_of(ev)
            if bound is not FIRST_SENDER and sender not in bound:
                shard.counts[Outcome.FORGED.index] += 1
                return Result(Outcome.FORGED, tx.state, NO_EFFECTS)
        if step is None:
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, tx.state, NO_EFFECTS)
        result = step(shard, tx, ev)
        if bound is FIRST_SENDER and result.outcome is _APPLIED:
            # After the step, and only for a fact the spec took: a step that raised, or a
            # fact it ignored or refused, binds no one.
            tx._senders = frozenset((sender,))
        return result

    def _duplicate_create(self, shard: Shard, tx, ev: Event) -> Result:
        shard.counts[Outcome.DUPLICATE.index] += 1
        return Result(Outcome.DUPLICATE, tx.state, NO_EFFECTS)

    # -- events for transfers that are not live -------------------------------------------

    def _dispatch_absent(self, shard: Shard, ev: Event) -> Result:
        tid = ev.transfer_id
        counts = shard.counts
        if tid in shard.ended:
            counts[Outcome.LATE.index] += 1
            return Result(Outcome.LATE, shard.ended[tid], NO_EFFECTS)
        if ev.kind in self._creators:
            return self._create(shard, ev)
        if ev.kind in self._remote_payloads:
            if not self._payload_ok(ev) or ev.source.__class__ is not str:
                counts[_REJECTED.index] += 1
                return Result(_REJECTED, None, NO_EFFECTS)
            kept, evicted = shard.early.hold(ev)
            if evicted:
                counts[Outcome.BUFFERED.index] -= evicted
                counts[Outcome.DROPPED.index] += evicted
            if kept:
                counts[Outcome.BUFFERED.index] += 1
                return _HELD
            counts[Outcome.DROPPED.index] += 1
            return _DROPPED
        counts[Outcome.UNKNOWN.index] += 1
        return _UNKNOWN

    def _payload_ok(self, ev: Event) -> bool:
        """Whether a peer's event for a transfer not created yet has its payload of the
        declared types (held facts are checked before they are kept)."""
        for name, type_name in self._remote_payloads.get(ev.kind, ()):
            value = getattr(ev, name, None)
            if type_name == "int":
                if value.__class__ is not int:
                    return False
            elif not value_fits(value, type_name):
                return False
        return True

    def _run_step(self, shard: Shard, tx, ev: Event) -> Result:
        step = self._steps[tx.state].get(ev.kind)
        if step is None:
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, tx.state, NO_EFFECTS)
        return step(shard, tx, ev)

    def _create(self, shard: Shard, ev: Event) -> Result:
        tx = self.machine.record_class(ev.transfer_id)
        step = self._creating_steps.get(ev.kind)
        bound = bound_senders(ev.source)
        if step is None or bound is _REJECTED:
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, None, NO_EFFECTS)
        tx._senders = bound
        result = step(shard, tx, ev)
        if result.outcome is not _APPLIED:
            # The spec refused the creating event itself (a guard on its payload): nothing
            # is created, armed or remembered. The step counted it already.
            shard.counts[result.outcome.index] -= 1
            shard.counts[_REJECTED.index] += 1
            return Result(_REJECTED, None, NO_EFFECTS)
        if not result.hops:
            # Still in the initial state: arm its timers now (a step that left it armed
            # the timers of the states it went through itself).
            for index in self._initial_timers:
                if tx.deadlines[index] is None:
                    self._arm(tx, index, ev.time)
        shard.counts[_APPLIED.index] -= 1
        shard.counts[Outcome.CREATED.index] += 1
        fresh, expired = shard.early.take(ev.transfer_id, ev.time) if len(shard.early) else ((), 0)
        if not fresh and not expired:
            if tx.state not in self._final:  # else: ended in its creating step, retired
                shard.live[ev.transfer_id] = tx
            return Result(Outcome.CREATED, tx.state, result.effects, result.hops)
        shard.counts[Outcome.BUFFERED.index] -= len(fresh) + expired
        shard.counts[Outcome.DROPPED.index] += expired
        if tx.state in self._final:  # ended in its creating step: retired already
            shard.counts[Outcome.LATE.index] += len(fresh)
            return Result(Outcome.CREATED, tx.state, result.effects or NO_EFFECTS, result.hops)
        shard.live[ev.transfer_id] = tx
        return self._apply_held(shard, tx, ev, fresh, result)

    def _apply_held(
        self, shard: Shard, tx, ev: Event, fresh: Sequence[Event], created: Result
    ) -> Result:
        """Apply the peer's facts held for the transfer ``ev`` just created, in arrival
        order; the result is the creation's, with the effects and hops of all of them."""
        effects = list(created.effects)
        hops = list(created.hops or ())
        for held in fresh:
            if shard.live.get(ev.transfer_id) is not tx:
                shard.counts[Outcome.LATE.index] += 1  # an earlier held fact ended it
                continue
            try:
                held_result = self._run_step(shard, tx, held)
                if held_result.outcome is Outcome.FORGED:
                    log.warning(
                        "%s: a %s held for %r came from %r, not from the peer the "
                        "transfer is bound to; refused",
                        self.spec.name,
                        held.kind,
                        ev.transfer_id,
                        sender_of(held),
                    )
            except TransitionError as exc:
                # The transfer was created; a held fact whose step broke was rolled back
                # and counts as rejected. Its error is a binding's bug: say so loudly.
                shard.counts[_REJECTED.index] += 1
                log.error(
                    "%s: a held %s for %r could not be applied at creation: %s",
                    self.spec.name,
                    held.kind,
                    ev.transfer_id,
                    exc,
                )
                continue
            effects.extend(held_result.effects)
            hops.extend(held_result.hops or ())
        return Result(Outcome.CREATED, tx.state, effects or NO_EFFECTS, tuple(hops) or None)
