"""Guards and actions that several specs declare with one meaning, bound under one name.

The request's end, a message that could not be sent and an end reason being recorded mean
the same to every machine that declares them; one function each keeps them from drifting.
"""

from __future__ import annotations

from ..runtime.bindings import Action, Bindings


def local_request_finished(tx, ev) -> bool:
    return tx.request_finished


def note_request_finished(tx, ev, out) -> None:
    tx.request_finished = True


def count_notify_failure(tx, ev, out) -> None:
    tx.notify_failures += 1


def recording_end_reason(name: str, reason: str) -> Action:
    """The action ``name``, which records the end reason ``reason`` and does nothing else.

    A closure, so a generated step calls it instead of inlining it: one call per ending
    transfer, never per layer.
    """

    def record(tx, ev, out) -> None:
        tx.end_reason = reason

    record.__name__ = record.__qualname__ = name
    return record


def bind_end_reasons(bindings: Bindings, **reasons: str) -> None:
    """Bind one ``recording_end_reason`` action per ``action_name=reason``."""
    for name, reason in reasons.items():
        bindings.action(recording_end_reason(name, reason))
