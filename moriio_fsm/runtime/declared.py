"""One class per declared event kind and per declared effect kind, shared by every spec.

Rules: a kind means one thing everywhere. The first spec bound with a kind makes its
class, a frozen msgspec Struct built in C: an event is ``transfer_id, time``, its
declared payload fields in order and ``source`` (keyword only); an effect is
``transfer_id`` and then its declared fields. A later spec that declares the same kind with other fields is
refused with both declarations named. ``events.<kind>(...)`` and ``emits.<kind>(...)``
build them; the kinds of the shipped specs are known as soon as they are first asked for.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec

from ..lang.errors import Problem, SpecError
from ..lang.model import Spec
from ..lang.shipped import SHIPPED_SPECS, load_machine_spec
from .events import Effect, Event

_PYTHON_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list": list,
    "tuple": tuple,
    "any": object,
}

_lock = threading.Lock()
_classes: dict[tuple[str, str], type] = {}  # (family, kind) -> class
_declared_by: dict[tuple[str, str], tuple[tuple, str]] = {}  # -> (fields, spec path)
_shipped_loaded = False


def _class_name(kind: str) -> str:
    return "".join(part.capitalize() for part in kind.split("_")) or "Unnamed"


def _make(family: str, kind: str, fields: tuple, doc: str) -> type:
    if family == "event":
        spec_fields = []
        for name, type_name, default in fields:
            annotation = _PYTHON_TYPES[type_name]
            spec_fields.append(
                (name, annotation) if default is _REQUIRED else (name, annotation, default)
            )
        return msgspec.defstruct(
            _class_name(kind),
            spec_fields,
            bases=(Event,),
            frozen=True,
            gc=False,
            module=__name__,
            namespace={"kind": kind, "__doc__": doc},
        )
    return msgspec.defstruct(
        _class_name(kind),
        [(n, _PYTHON_TYPES[t]) for n, t, _ in fields],
        bases=(Effect,),
        frozen=True,
        gc=False,
        module=__name__,
        namespace={"kind": kind, "__doc__": doc},
    )


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED = _Required()


def register_spec(spec: Spec) -> tuple[dict[str, type], dict[str, type]]:
    """Make (or find) the class of every event and effect kind ``spec`` declares; return
    ``(event classes, effect classes)`` by kind. ``SpecError`` when a kind is already
    declared with other fields by another spec."""
    problems: list[Problem] = []
    found: dict[str, dict[str, type]] = {"event": {}, "effect": {}}
    entries = [
        (
            "event",
            name,
            tuple((f, t, e.defaults.get(f, _REQUIRED)) for f, t in e.payload.items()),
            e.doc,
            e.line,
        )
        for name, e in spec.events.items()
    ]
    entries += [
        ("effect", name, tuple((f, t, _REQUIRED) for f, t in e.fields.items()), e.doc, e.line)
        for name, e in spec.emits.items()
    ]
    with _lock:
        for family, kind, fields, doc, line in entries:
            key = (family, kind)
            known = _declared_by.get(key)
            if known is not None:
                if known[0] != fields:
                    problems.append(
                        Problem(
                            spec.path,
                            line,
                            f"{family} {kind!r} is declared with fields "
                            f"{_describe(fields)} here but with {_describe(known[0])} in {known[1]}; "
                            "one kind has one meaning in every spec",
                        )
                    )
                    continue
                found[family][kind] = _classes[key]
                continue
            cls = _make(family, kind, fields, doc or f"The {kind!r} {family}.")
            _classes[key] = found[family][kind] = cls
            _declared_by[key] = (fields, spec.path)
    if problems:
        raise SpecError(problems)
    return found["event"], found["effect"]


def _describe(fields: tuple) -> str:
    return (
        "{"
        + ", ".join(f"{n}: {t}" + ("" if d is _REQUIRED else f" = {d!r}") for n, t, d in fields)
        + "}"
    )


def _lookup(family: str, kind: str) -> type:
    global _shipped_loaded
    cls = _classes.get((family, kind))
    if cls is None and not _shipped_loaded:
        _shipped_loaded = True
        for name in SHIPPED_SPECS:
            register_spec(load_machine_spec(name))
        cls = _classes.get((family, kind))
    if cls is None:
        known = sorted(k for f, k in _classes if f == family)
        raise LookupError(
            f"{family} kind {kind!r} is not declared by any spec bound so far; "
            f"known: {', '.join(known) or 'none'}"
        )
    return cls


def event_class(kind: str) -> type:
    """The class of event ``kind``; ``LookupError`` if no spec declares it."""
    return _lookup("event", kind)


def effect_class(kind: str) -> type:
    """The class of effect ``kind``; ``LookupError`` if no spec declares it."""
    return _lookup("effect", kind)


def make_event(
    kind: str, transfer_id: str, time: float = 0.0, data: dict | None = None, source: str = ""
) -> Event:
    """Build event ``kind`` from a plain payload dict (traces, wire adapters). Raises
    ``LookupError`` for an undeclared kind and ``TypeError`` naming a missing or unknown
    payload field."""
    return event_class(kind)(transfer_id, time, **(data or {}), source=source)


class _Namespace:
    def __init__(self, lookup):
        self._lookup = lookup

    def __getattr__(self, kind: str) -> type:
        if kind.startswith("_"):
            raise AttributeError(kind)
        cls = self._lookup(kind)
        setattr(self, kind, cls)  # later lookups are plain attribute reads
        return cls


#: ``events.<kind>(transfer_id, time, *payload, source="")`` builds an event.
events = _Namespace(event_class)
#: ``emits.<kind>(transfer_id, **fields)`` builds an effect (actions use it).
emits = _Namespace(effect_class)
