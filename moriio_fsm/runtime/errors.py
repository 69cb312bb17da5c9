"""Errors the runtime raises: a binding that failed, and a spec invariant that broke.

Both leave the transfer exactly as it was before the step (steps are atomic) and name
the machine, the transfer, the event and, where known, the binding and the spec row.
"""

from __future__ import annotations

from ..errors import MoriioFsmError


class TransitionError(MoriioFsmError, RuntimeError):
    """A guard or action raised: a bug in a machine module, never a peer's fault.

    ``transfer_id``, ``event`` and ``binding`` say where; the original exception is the
    ``__cause__``. The transfer's record was restored to its state before the step.
    """

    def __init__(self, message: str, *, transfer_id: str = "", event: str = "", binding: str = ""):
        super().__init__(message)
        self.transfer_id = transfer_id
        self.event = event
        self.binding = binding


class InvariantViolation(MoriioFsmError, AssertionError):
    """A spec invariant stopped holding after a step (raised only when checking is on);
    the step was rolled back."""


class TimerStepsFailed(TransitionError):
    """``advance`` fired every due timer, but the steps of some raised (bindings' bugs).

    ``fired`` holds the ``(event, Result)`` of every timer step that ran, so none of their
    effects is lost; ``errors`` the ``TransitionError`` of each that failed. A failed
    timer stays armed and is retried one duration later.
    """

    def __init__(self, fired: list, errors: list):
        first = errors[0]
        super().__init__(
            f"{len(errors)} timer step(s) failed; first: {first}",
            transfer_id=first.transfer_id,
            event=first.event,
            binding=first.binding,
        )
        self.fired = fired
        self.errors = errors
