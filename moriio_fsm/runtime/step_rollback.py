"""What generated steps call while they run: the effect list of a row that declares no
emits, and the rollback of a step that raised.

Rules: a row that declares no emits cannot emit (any way of adding to its list raises
``TransitionError``); a failed step puts back every field it saved and its state, so
the transfer is exactly as it was before the event.
"""

from __future__ import annotations

from typing import Any, NoReturn

from .errors import TransitionError


class NoEffects(list):
    """The ``out`` handed to actions of rows that declare no emits: it stays empty, and
    any way of adding to it raises (one instance is shared by every step)."""

    __slots__ = ()

    def _refuse(self, *items: Any) -> NoReturn:
        kinds = ", ".join(repr(getattr(item, "kind", item)) for item in items) or "an effect"
        raise TransitionError(f"an action emitted {kinds} from a row that declares no emits")

    def append(self, effect: Any) -> None:
        self._refuse(effect)

    def extend(self, effects: Any) -> None:
        self._refuse(*list(effects))

    def insert(self, index: Any, effect: Any) -> None:
        self._refuse(effect)

    # mypy holds any __iadd__ of a list subclass against list's overloaded __add__.
    def __iadd__(self, effects: Any) -> NoReturn:  # type: ignore[misc]
        self._refuse(*list(effects))

    def __setitem__(self, index: Any, effect: Any) -> None:
        self._refuse(effect)


def restore(tx: Any, frame_locals: dict, state: str) -> None:
    """Put back every field the failed step saved (its ``saved_<field>`` locals), or in
    check mode the whole context it saw before (``before``): a binding that wrote an
    undeclared field is caught there and must not leave the write behind."""
    before = frame_locals.get("before")
    if before is not None:
        for field, value in before.items():
            setattr(tx, field, value)
    for field in tx.field_names:
        key = "saved_" + field
        if key in frame_locals:
            setattr(tx, field, frame_locals[key])
    tx.state = state
