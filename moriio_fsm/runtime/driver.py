"""The driver: carries out the effects a table's steps emit, with one handler per kind.

Rules: a driver starts only when every effect kind its spec declares has a handler (and
no handler is bound to a kind the spec does not declare). It runs handlers with no lock
held, in the order the steps emitted them. A handler may return events (one, several or
None); they are dispatched after the effects already pending, in order. A handler that
raises never loses its transfer: the driver dispatches the emit's declared
``on_failure`` event to it, carrying the effect's fields the event declares and the
error; an effect whose kind has no ``on_failure`` (the validator allows that only for
effects emitted into final states) is counted and logged. No lifecycle rule lives
here: what an event means is the spec's business.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import MoriioFsmError
from .declared import make_event
from .errors import TimerStepsFailed, TransitionError
from .events import Effect, Event
from .table import Result, TransferTable

log = logging.getLogger("moriio_fsm.driver")

Handler = Callable[[Effect], "Event | Iterable[Event] | None"]


class DriverError(MoriioFsmError, ValueError):
    """The handlers given to a driver do not match the effect kinds its spec declares."""


class Driver:
    """Dispatches events to ``table`` and carries out every effect through ``handlers``.

    ``clock`` stamps the failure events the driver makes itself (monotonic seconds).
    ``dispatch`` and ``advance`` may be called from several threads at once; each call
    carries out the effects of the events it dispatched, and of the events their
    handlers returned, before it returns.
    """

    def __init__(
        self,
        table: TransferTable,
        handlers: Mapping[str, Handler],
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        spec = table.spec
        declared = set(spec.emits)
        given = set(handlers)
        problems = []
        missing = sorted(declared - given)
        if missing:
            problems.append(
                f"no handler for effect kind(s) {', '.join(missing)} that {spec.name} emits"
            )
        unknown = sorted(given - declared)
        if unknown:
            problems.append(
                f"handler(s) for {', '.join(unknown)}, which {spec.name} does not "
                f"emit (it declares {', '.join(sorted(declared))})"
            )
        not_callable = sorted(k for k, h in handlers.items() if not callable(h))
        if not_callable:
            problems.append(f"handler(s) for {', '.join(not_callable)} are not callable")
        if problems:
            raise DriverError("; ".join(problems))
        self.table = table
        self._handlers = dict(handlers)
        self._clock = clock
        self._failure_kind = {name: emit.on_failure for name, emit in spec.emits.items()}
        self._failure_fields = {
            name: tuple(spec.events[emit.on_failure].payload) if emit.on_failure else ()
            for name, emit in spec.emits.items()
        }
        self._counts_lock = threading.Lock()
        self.handler_failures: dict[str, int] = {}
        self.unreported_failures = 0

    def dispatch(self, event: Event) -> list[tuple[Event, Result]]:
        """Dispatch ``event``, carry out its effects and dispatch what the handlers
        return, until nothing is pending; return every (event, result) in order.

        A step that raises (a binding's bug) does not stop the others: everything pending
        is still dispatched and carried out, then the first error is raised."""
        return self._drain(deque([event]))

    def advance(self, now: float | None = None) -> list[tuple[Event, Result]]:
        """Fire every timer due at ``now`` (the clock when None) and carry out the
        effects of the fired steps, even when some timer steps failed (their error is
        raised once everything else was done)."""
        failure: TimerStepsFailed | None = None
        try:
            fired = self.table.advance(self._clock() if now is None else now)
        except TimerStepsFailed as exc:
            fired, failure = exc.fired, exc
        done: list[tuple[Event, Result]] = []
        pending: deque[Event] = deque()
        for event, result in fired:
            done.append((event, result))
            self._carry_out(result, pending)
        done.extend(self._drain(pending))
        if failure is not None:
            raise failure
        return done

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            return {
                "handler_failures": dict(self.handler_failures),
                "unreported_failures": self.unreported_failures,
            }

    # -- internals --------------------------------------------------------------------

    def _drain(self, pending: deque) -> list[tuple[Event, Result]]:
        done: list[tuple[Event, Result]] = []
        dispatch = self.table.dispatch
        first_error: TransitionError | None = None
        while pending:
            event = pending.popleft()
            try:
                result = dispatch(event)
            except TransitionError as exc:
                first_error = first_error or exc
                continue
            done.append((event, result))
            self._carry_out(result, pending)
        if first_error is not None:
            raise first_error
        return done

    def _carry_out(self, result: Result, pending: deque) -> None:
        for effect in result.effects:
            try:
                produced = self._handlers[effect.kind](effect)
                if produced is None:
                    continue
                if isinstance(produced, Event):
                    pending.append(produced)
                    continue
                if isinstance(produced, (str, bytes)) or not hasattr(produced, "__iter__"):
                    raise TypeError(
                        f"the handler returned {type(produced).__name__}; expected "
                        "an Event, an iterable of events, or None"
                    )
                events_out = list(produced)  # a generator may raise right here
                bad = [e for e in events_out if not isinstance(e, Event)]
                if bad:
                    raise TypeError(
                        f"the handler returned {type(bad[0]).__name__} among its "
                        "events; expected Event instances"
                    )
            except Exception as exc:  # the transfer hears of it; it is never lost
                failure = self._failure_event(effect, exc)
                if failure is not None:
                    pending.append(failure)
                continue
            pending.extend(events_out)

    def _failure_event(self, effect: Effect, exc: Exception) -> Event | None:
        kind = effect.kind
        with self._counts_lock:
            self.handler_failures[kind] = self.handler_failures.get(kind, 0) + 1
        error = f"{type(exc).__name__}: {exc}"
        failure_kind = self._failure_kind.get(kind)
        if failure_kind is None:
            with self._counts_lock:
                self.unreported_failures += 1
            log.error(
                "handler of %s for transfer %r failed and %s declares no on_failure "
                "event for it: %s",
                kind,
                effect.transfer_id,
                self.table.spec.name,
                error,
            )
            return None
        log.warning(
            "handler of %s for transfer %r failed (%s); dispatching %s",
            kind,
            effect.transfer_id,
            error,
            failure_kind,
        )
        fields = effect.data
        data = {name: fields[name] for name in self._failure_fields[kind] if name in fields}
        if "error" in self._failure_fields[kind]:
            data["error"] = error
        return make_event(failure_kind, effect.transfer_id, self._clock(), data)
