"""The sections of what crosses a machine's edge: events (with their payload fields and
defaults) and emits (effect kinds, with their fields and the event a failure becomes).

Rules: a reader records each problem on the ``SpecReader`` with its line and never raises;
reserved or ill-typed field names are refused; emits are read after events.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .model import EVENT_FIELDS, EVENT_ORIGINS, FIELD_TYPES, EmitSpec, EventSpec
from .spec_reader import RESERVED_PREFIX, SpecReader, out_of_range, reserved_message
from .yaml_lines import line_of, show


def read_events(r: SpecReader, raw: dict) -> dict[str, EventSpec]:
    events: dict[str, EventSpec] = {}
    for key, entry, line in r.entries(raw, "events", "event", required=True):
        entry = entry if isinstance(entry, dict) else {}
        origin = entry.get("origin")
        if origin not in EVENT_ORIGINS:
            r.problem(
                line,
                f"event {key!r}: origin must be one of {', '.join(EVENT_ORIGINS)}, "
                f"got {show(origin)}",
            )
            origin = "local"
        raw_payload = entry.get("payload") or {}
        if not isinstance(raw_payload, dict):
            r.problem(line, f"event {key!r}: payload must map field names to types")
            raw_payload = {}
        payload, defaults = read_payload(r, key, raw_payload, line)
        creates = r.flag(entry, "creates", line, f"event {key!r}")
        if creates and origin != "local":
            r.problem(
                line,
                f"event {key!r} creates transfers but its origin is {origin!r}; "
                "only local events may create a transfer (a peer's message never does)",
            )
        events[key] = EventSpec(
            key, origin, r.text(entry.get("doc"), line, "doc"), payload, creates, line, defaults
        )
    return events


def read_payload(
    r: SpecReader, event: str, raw_payload: dict, line: int
) -> tuple[dict[str, str], dict[str, Any]]:
    """An event's payload fields (name -> type) and their defaults. A default that does
    not fit is kept in ``defaults`` (its field is refused), as the model records it."""
    payload: dict[str, str] = {}
    defaults: dict[str, Any] = {}
    for field_name, declared in raw_payload.items():
        field_line = line_of(raw_payload, field_name, line)
        where = f"event {event!r}: payload field"
        if isinstance(field_name, str) and field_name.startswith(RESERVED_PREFIX):
            r.problem(
                field_line, f"event {event!r}: " + reserved_message("payload field", field_name)
            )
            continue
        if (
            not isinstance(field_name, str)
            or not field_name.isidentifier()
            or field_name in EVENT_FIELDS
            or field_name.startswith("_")
        ):
            r.problem(
                field_line,
                f"{where} name {show(field_name)} must be an identifier other "
                "than " + ", ".join(sorted(EVENT_FIELDS)) + " (and not starting with '_')",
            )
            continue
        type_name = declared
        if isinstance(declared, dict):
            type_name = declared.get("type")
            if "default" in declared:
                defaults[field_name] = declared["default"]
            extra = set(declared) - {"type", "default"}
            if extra:
                r.problem(
                    field_line,
                    f"{where} {field_name!r}: unknown key(s) "
                    f"{', '.join(sorted(map(str, extra)))}; expected type and default",
                )
        if not isinstance(type_name, str) or type_name not in FIELD_TYPES:
            r.problem(
                field_line,
                f"{where} {field_name!r} has unknown type {show(type_name)}; "
                f"expected one of {', '.join(FIELD_TYPES)}",
            )
            continue
        if field_name in defaults and not _default_fits(defaults[field_name], type_name):
            r.problem(
                field_line,
                f"{where} {field_name!r}: default "
                f"{show(defaults[field_name])} is not of type {type_name}",
            )
            continue
        if (
            field_name in defaults
            and type_name in ("int", "float")
            and out_of_range(defaults[field_name])
        ):
            r.problem(
                field_line,
                f"{where} {field_name!r}: default "
                f"{show(defaults[field_name])} is out of range; numbers must "
                "be finite, above -2**63 and below 2**63",
            )
            continue
        if defaults and field_name not in defaults:
            r.problem(
                field_line,
                f"{where} {field_name!r} has no default but comes after one "
                "that has; list required fields first",
            )
            continue
        payload[field_name] = type_name
    return payload, defaults


def _default_fits(value: Any, type_name: str) -> bool:
    return isinstance(value, FIELD_TYPES[type_name]) and not (
        isinstance(value, bool) and type_name in ("int", "float")
    )


def read_emits(r: SpecReader, raw: dict, events: dict) -> dict[str, EmitSpec]:
    emits: dict[str, EmitSpec] = {}
    for key, entry, line in r.entries(raw, "emits", "emit"):
        if not isinstance(entry, dict):
            r.problem(line, f"emit {key!r} must be a mapping with doc, fields and on_failure")
            continue
        r.unknown_keys(
            entry, ("doc", "fields", "on_failure"), line, f"emit {key!r}", "doc, fields, on_failure"
        )
        fields = read_emit_fields(r, key, entry, line)
        on_failure = r.name(
            entry.get("on_failure"), line_of(entry, "on_failure", line), f"emit {key!r} on_failure"
        )
        if on_failure is not None and on_failure not in events:
            r.problem(
                line_of(entry, "on_failure", line),
                f"emit {key!r}: on_failure names unknown event {on_failure!r}",
            )
        emits[key] = EmitSpec(
            key,
            r.text(entry.get("doc"), line, f"emit {key!r} doc"),
            {k: str(v) for k, v in fields.items()},
            on_failure,
            line,
        )
    return emits


def read_emit_fields(r: SpecReader, emit: str, entry: dict, line: int) -> dict:
    fields = entry.get("fields") or {}
    if not isinstance(fields, dict) or not all(
        isinstance(k, str) and k.isidentifier() for k in fields
    ):
        r.problem(
            line_of(entry, "fields", line),
            f"emit {emit!r}: fields must map field names to type names",
        )
        fields = {}
    for field_name in [f for f in fields if f.startswith(RESERVED_PREFIX)]:
        r.problem(
            line_of(fields, field_name, line),
            f"emit {emit!r}: " + reserved_message("emit field", field_name),
        )
        del fields[field_name]
    for field_name, type_name in fields.items():
        if not isinstance(type_name, Hashable) or type_name not in FIELD_TYPES:
            r.problem(
                line_of(fields, field_name, line),
                f"emit {emit!r}: field {field_name!r} has unknown type {show(type_name)}; "
                f"expected one of {', '.join(FIELD_TYPES)}",
            )
    return fields
