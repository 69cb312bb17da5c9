"""Load a spec from YAML into ``moriio_fsm.lang.model.Spec`` with precise errors.

The loader keeps the line of every mapping key and list item, so each problem it
or the validator reports points at ``file:line``. It collects all problems of a
file and raises one ``SpecError`` listing them, rather than stopping at the first.

Rules: every input, however broken or hostile, ends in a spec or a ``SpecError``, in
time and memory bounded by the file's size, which is itself bounded (``MAX_SPEC_BYTES``).
YAML features a spec never needs and that can make a small file huge or deep (anchors
and aliases, deep nesting, giant integers) are refused where they appear.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from .errors import Problem, SpecError
from .expr import FUNCTIONS, show_int
from .model import (CONTEXT_TYPES, EVENT_FIELDS, EVENT_ORIGINS, FIELD_TYPES, RESERVED_NAMES,
                    TRANSITION_OUTCOMES, ActionSpec, ConfigKey, ContextField, EmitSpec,
                    EventSpec, GuardSpec, InvariantSpec, Spec, StateSpec, TimerSpec,
                    TransitionSpec)


#: The largest spec file (in UTF-8 bytes) the loader reads. The shipped spec is ~21 KB; a
#: mebibyte of YAML takes the pure-Python parser several seconds already.
MAX_SPEC_BYTES = 1 << 20
#: How deep YAML collections may nest. A spec needs about six levels (top level,
#: transitions, a row, its sources); the composer and constructor recurse per level.
MAX_NESTING = 32
#: The longest integer literal read at all. Python refuses to convert more than 4300
#: digits (with a ValueError of its own); the loader's range checks report the rest.
MAX_INT_DIGITS = 4000
#: Integers a spec gives (config defaults, context initials, payload defaults) stay in
#: the signed 64-bit range, the range the runtime, codecs and wire formats assume.
MAX_INT = 2 ** 63
#: Names starting with this are the runtime's (e.g. the pytransitions trigger of eventless
#: rows is ``__eventless__``; dunders are Python's); no spec name may take them.
RESERVED_PREFIX = "__"


class _Refused(Exception):
    """A YAML construct a spec may not use, found while composing (line, message)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


class _LineDict(dict):
    line: int = 0
    key_lines: dict[str, int]


class _LineList(list):
    line: int = 0
    item_lines: list[int]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records 1-based lines, refuses duplicate keys, and refuses, before
    building them, anchors and aliases, nesting deeper than ``MAX_NESTING`` and integers
    longer than ``MAX_INT_DIGITS``."""

    duplicate_keys: list[tuple[int, str]]
    depth = 0

    def compose_node(self, parent, index):  # type: ignore[override]
        # The parser is iterative but the composer recurses once per level, so the depth
        # is checked here, before the next level is composed. Aliases are refused rather
        # than bounded: nine aliases of nine aliases of ... make a 1.5 KB file expand to
        # billions of nodes wherever a value is walked or quoted back in a message.
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(event.start_mark.line + 1,
                           "anchors (&name) and aliases (*name) are not allowed in a spec: "
                           "write the value out where it is used")
        self.depth += 1
        try:
            if self.depth > MAX_NESTING:
                raise _Refused(event.start_mark.line + 1,
                               f"lists and mappings are nested deeper than {MAX_NESTING} levels; "
                               "a spec needs about six")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node):  # type: ignore[override]
        if len(node.value) > MAX_INT_DIGITS:
            raise _Refused(node.start_mark.line + 1,
                           f"integer of {len(node.value)} digits; numbers in a spec have at most "
                           f"{MAX_INT_DIGITS} digits (and most must be below 2**63)")
        return super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        result = _LineDict()
        result.line = node.start_mark.line + 1
        result.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    "found a key that is a list or mapping; keys must be names", key_node.start_mark)
            if key in result:
                self.duplicate_keys.append((key_node.start_mark.line + 1, str(key)))
            result[key] = self.construct_object(value_node, deep=True)
            result.key_lines[key] = key_node.start_mark.line + 1
        return result

    def construct_sequence(self, node, deep=False):  # type: ignore[override]
        result = _LineList(self.construct_object(child, deep=True) for child in node.value)
        result.line = node.start_mark.line + 1
        result.item_lines = [child.start_mark.line + 1 for child in node.value]
        return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                            _LineLoader.construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG,
                            _LineLoader.construct_sequence)
_LineLoader.add_constructor("tag:yaml.org,2002:int", _LineLoader.construct_yaml_int)

class _ShortRepr(reprlib.Repr):
    """Values quoted back in messages, cut short: a message stays one line, whatever the
    value. reprlib dispatches on the type's name, so the loader's own dict and list types
    are routed to the abbreviating methods (else it would build their full repr first)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 6

    def repr_int(self, x: int, level: int) -> str:
        return show_int(x)

    def repr__LineDict(self, x: dict, level: int) -> str:
        return self.repr_dict(x, level)

    def repr__LineList(self, x: list, level: int) -> str:
        return self.repr_list(x, level)


_repr = _ShortRepr()


def _show(value: Any) -> str:
    """``repr(value)``, abbreviated (long strings, big ints and big lists are cut)."""
    return _repr.repr(value)


def _listing(names: Any, shown: int = 20) -> str:
    """``a, b, c`` for a message; a long list shows its first names and counts the rest,
    so that a thousand problems in a spec of thousands of names stay small."""
    names = list(names)
    if len(names) <= shown:
        return ", ".join(map(str, names))
    return ", ".join(map(str, names[:shown])) + f", ... ({len(names) - shown} more)"


def _out_of_range(value: Any) -> bool:
    """True for an int outside the signed 64-bit range or a float that is not finite."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -MAX_INT < value < MAX_INT
    return isinstance(value, float) and not math.isfinite(value)


def _too_big(path: str, size: str) -> Problem:
    """The refusal of a spec over ``MAX_SPEC_BYTES`` (line 0: the whole file)."""
    return Problem(path, 0, f"spec is {size}; a spec may be at most {MAX_SPEC_BYTES // 2 ** 20} MiB "
                            f"({MAX_SPEC_BYTES} bytes) of UTF-8: split it into several specs")


def _mib(size: int) -> str:
    return f"{size / 2 ** 20:.1f} MiB ({size} bytes)"


def _kind(value: Any) -> str:
    """The YAML word for a value's type, for messages ("mapping", "list", "str")."""
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _line_of(container: Any, key: Any, default: int) -> int:
    """The line of ``container[key]``, or ``default`` (the owner's line) when it is absent."""
    if isinstance(container, _LineDict):
        return container.key_lines.get(key, default)
    if isinstance(container, _LineList) and isinstance(key, int) and key < len(container.item_lines):
        return container.item_lines[key]
    return default


class _Reader:
    """Turns the raw YAML tree into model objects, collecting problems on the way."""

    def __init__(self, path: str):
        self.path = path
        self.problems: list[Problem] = []

    def problem(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.path, line, message))

    def mapping(self, parent: Any, key: str, line: int, required: bool = True) -> _LineDict:
        value = parent.get(key) if isinstance(parent, dict) else None
        if value is None:
            if required:
                self.problem(line, f"missing section {key!r} (expected a mapping)")
            return _LineDict()
        if not isinstance(value, dict):
            self.problem(_line_of(parent, key, line), f"{key!r} must be a mapping, got {_kind(value)}")
            return _LineDict()
        return value

    def names(self, raw: Any, line: int, what: str) -> tuple[str, ...]:
        """A state/event list may be one name or a list of names."""
        if isinstance(raw, str):
            return (raw,)
        if isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
            return tuple(raw)
        self.problem(line, f"{what} must be a name or a non-empty list of names, got {_show(raw)}")
        return ()

    def name(self, raw: Any, line: int, what: str) -> str | None:
        """An optional single name (event, guard, dest); anything else is a problem."""
        if raw is None or isinstance(raw, str):
            return raw
        self.problem(line, f"{what} must be a name, got {_show(raw)}")
        return None

    def flag(self, entry: dict, key: str, line: int, what: str) -> bool:
        """An optional true/false; a string such as 'no' must not read as true."""
        value = entry.get(key, False)
        if not isinstance(value, bool):
            self.problem(_line_of(entry, key, line), f"{what}: {key!r} must be true or false, got {_show(value)}")
            return False
        return value

    def text(self, raw: Any, line: int, what: str) -> str:
        if raw is None:
            return ""
        if not isinstance(raw, str):
            self.problem(line, f"{what} must be text, got {_kind(raw)}")
            return ""
        return raw.strip()


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file.

    Raises ``SpecError`` listing every problem with its ``file:line``; the spec is
    returned only when it passed every check in ``moriio_fsm.lang.validate``.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            # Read one byte past the cap, never more: a huge file or an endless one
            # (/dev/zero) costs no more memory than a spec that is just too big.
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError([Problem(str(path), 0, f"cannot read spec: {exc.strerror}")]) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError([_too_big(str(path), _mib(max(size, len(data))))])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError([Problem(str(path), line, f"spec is not UTF-8: byte 0x{data[exc.start]:02x} "
                                                  f"at column {column} cannot be decoded "
                                                  f"({exc.reason}); save the spec as UTF-8")]) from None
    spec = parse_spec(text, str(path))
    from .validate import validate_spec  # local import: validate depends on model only

    problems = validate_spec(spec)
    if problems:
        raise SpecError(problems)
    return spec


def parse_spec(text: str, path: str = "<string>") -> Spec:
    """Parse YAML text into a ``Spec`` without the structural checks of ``validate``.

    Raises ``SpecError`` for YAML syntax errors, duplicate keys, missing sections,
    wrong types and references to undeclared names.
    """
    # Characters first: there are no more of them than bytes, so only a text that may
    # be under the cap is encoded to measure it (costing at most 4 MiB).
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError([_too_big(path, f"{len(text)} characters long")])
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise SpecError([_too_big(path, _mib(size))])
    try:
        loader = _LineLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise SpecError([Problem(path, line, f"invalid YAML: character {chr(exc.character)!r} is not "
                                             "allowed in a YAML file")]) from None
    loader.duplicate_keys = []
    try:
        raw = loader.get_single_data()
    except _Refused as exc:
        raise SpecError([Problem(path, exc.line, exc.message)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise SpecError([Problem(path, line, f"invalid YAML: {getattr(exc, 'problem', exc)}")]) from None
    finally:
        loader.dispose()
    r = _Reader(path)
    for line, key in loader.duplicate_keys:
        r.problem(line, f"duplicate key {key!r}: each name may appear once")
    if not isinstance(raw, dict):
        raise SpecError([Problem(path, 1, "a spec must be a YAML mapping at the top level")] + r.problems)

    known_top = {"name", "summary", "initial", "config", "context", "states", "events", "guards",
                 "actions", "emits", "timers", "transitions", "invariants"}
    for key in raw:
        if key == "effects":
            r.problem(_line_of(raw, key, 1), "'effects' is not a section: updates of the context "
                                             "are 'actions' (with the fields each 'writes') and "
                                             "what the outside world must do are 'emits' (with "
                                             "their 'fields')")
        elif key not in known_top:
            r.problem(_line_of(raw, key, 1), f"unknown top-level key {key!r}; expected one of {', '.join(sorted(known_top))}")

    name = raw.get("name")
    if not isinstance(name, str) or not name:
        r.problem(_line_of(raw, "name", 1), "missing or empty 'name' (expected the machine's name)")
        name = "<unnamed>"
    summary = r.text(raw.get("summary"), _line_of(raw, "summary", 1), "summary")

    def reserved_message(what: str, key: str) -> str:
        return (f"{what} name {key!r} is reserved: names starting with '__' belong to the "
                "runtime (it names eventless rows '__eventless__') and to Python")

    def valid_name(key: Any, line: int, what: str, attribute: bool = False) -> bool:
        """Names are identifiers; context fields and config keys become record attributes,
        so they also may not shadow the record's own attributes or expression functions."""
        if not isinstance(key, str) or not key.isidentifier():
            r.problem(line, f"{what} name {_show(key)} must be an identifier (letters, digits, underscores)")
            return False
        if key.startswith(RESERVED_PREFIX):
            r.problem(line, reserved_message(what, key))
            return False
        if attribute and (key in RESERVED_NAMES or key in FUNCTIONS or key.startswith("_")):
            r.problem(line, f"{what} name {key!r} is reserved; avoid "
                            f"{', '.join(sorted(RESERVED_NAMES | set(FUNCTIONS)))} and leading underscores")
            return False
        return True

    config: dict[str, ConfigKey] = {}
    raw_config = r.mapping(raw, "config", 1, required=False)
    for key, entry in raw_config.items():
        line = _line_of(raw_config, key, 1)
        if not valid_name(key, line, "config key", attribute=True):
            continue
        # A key with a bad default is still declared, so that a timer naming it is not
        # reported too (the spec is refused either way).
        if not isinstance(entry, dict) or "default" not in entry:
            r.problem(line, f"config key {key!r} must be a mapping with a 'default'")
            config[key] = ConfigKey(key, None, "", line)
            continue
        default = entry["default"]
        if isinstance(default, bool) or not isinstance(default, (int, float)) \
                or not 0 < default < MAX_INT:
            r.problem(line, f"config key {key!r}: default must be a positive finite number "
                            f"below 2**63 (a duration or a limit), got {_show(default)}")
        config[key] = ConfigKey(key, default, r.text(entry.get("doc"), line, "doc"), line)

    context: dict[str, ContextField] = {}
    raw_context = r.mapping(raw, "context", 1, required=False)
    for key, entry in raw_context.items():
        line = _line_of(raw_context, key, 1)
        if not valid_name(key, line, "context field", attribute=True):
            continue
        if key in config:
            r.problem(line, f"context field {key!r} has the name of a config key; names must differ")
            continue
        ftype = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(ftype, str) or ftype not in CONTEXT_TYPES:
            r.problem(line, f"context field {key!r} needs a type, one of {', '.join(CONTEXT_TYPES)}; "
                            f"got {_show(ftype)}")
            continue
        initial = entry.get("initial")
        if initial is None and ftype != "object":
            r.problem(line, f"context field {key!r} of type {ftype} needs an 'initial' value")
        elif initial is not None and not isinstance(initial, CONTEXT_TYPES[ftype]) or (
                ftype in ("int", "bitmap", "float") and isinstance(initial, bool)):
            r.problem(line, f"context field {key!r}: initial value {_show(initial)} is not of "
                            f"type {ftype}")
        elif ftype != "object" and _out_of_range(initial):
            r.problem(line, f"context field {key!r}: initial value {_show(initial)} is out of "
                            "range; numbers must be finite, above -2**63 and below 2**63")
        context[key] = ContextField(key, ftype, initial, r.text(entry.get("doc"), line, "doc"), line)

    states: dict[str, StateSpec] = {}
    raw_states = r.mapping(raw, "states", 1)
    for key, entry in raw_states.items():
        line = _line_of(raw_states, key, 1)
        if not valid_name(key, line, "state"):
            continue
        entry = entry if isinstance(entry, dict) else {}
        for extra in entry:
            if extra not in ("doc", "final", "anomaly"):
                r.problem(_line_of(entry, extra, line), f"state {key!r}: unknown key {extra!r}; "
                                                        "expected doc, final, anomaly")
        final = r.flag(entry, "final", line, f"state {key!r}")
        anomaly = r.flag(entry, "anomaly", line, f"state {key!r}")
        if anomaly and not final:
            r.problem(_line_of(entry, "anomaly", line), f"state {key!r} is marked anomaly but is "
                                                        "not final; only a final state can be an anomaly")
        states[key] = StateSpec(key, r.text(entry.get("doc"), line, "doc"), final, line, anomaly)

    events: dict[str, EventSpec] = {}
    raw_events = r.mapping(raw, "events", 1)
    for key, entry in raw_events.items():
        line = _line_of(raw_events, key, 1)
        if not valid_name(key, line, "event"):
            continue
        entry = entry if isinstance(entry, dict) else {}
        origin = entry.get("origin")
        if origin not in EVENT_ORIGINS:
            r.problem(line, f"event {key!r}: origin must be one of {', '.join(EVENT_ORIGINS)}, got {_show(origin)}")
            origin = "local"
        raw_payload = entry.get("payload") or {}
        payload: dict[str, str] = {}
        defaults: dict[str, Any] = {}
        if not isinstance(raw_payload, dict):
            r.problem(line, f"event {key!r}: payload must map field names to types")
            raw_payload = {}
        for field_name, declared in raw_payload.items():
            field_line = _line_of(raw_payload, field_name, line)
            if isinstance(field_name, str) and field_name.startswith(RESERVED_PREFIX):
                r.problem(field_line, f"event {key!r}: " + reserved_message("payload field", field_name))
                continue
            if not isinstance(field_name, str) or not field_name.isidentifier() \
                    or field_name in EVENT_FIELDS or field_name.startswith("_"):
                r.problem(field_line, f"event {key!r}: payload field name {_show(field_name)} must "
                                      "be an identifier other than " + ", ".join(sorted(EVENT_FIELDS))
                                      + " (and not starting with '_')")
                continue
            if isinstance(declared, dict):
                type_name = declared.get("type")
                if "default" in declared:
                    defaults[field_name] = declared["default"]
                extra = set(declared) - {"type", "default"}
                if extra:
                    r.problem(field_line, f"event {key!r}: payload field {field_name!r}: unknown "
                                          f"key(s) {', '.join(sorted(map(str, extra)))}; expected "
                                          "type and default")
            else:
                type_name = declared
            if not isinstance(type_name, str) or type_name not in FIELD_TYPES:
                r.problem(field_line, f"event {key!r}: payload field {field_name!r} has unknown "
                                      f"type {_show(type_name)}; expected one of {', '.join(FIELD_TYPES)}")
                continue
            if field_name in defaults and not (
                    isinstance(defaults[field_name], FIELD_TYPES[type_name])
                    and not (isinstance(defaults[field_name], bool) and type_name in ("int", "float"))):
                r.problem(field_line, f"event {key!r}: payload field {field_name!r}: default "
                                      f"{_show(defaults[field_name])} is not of type {type_name}")
                continue
            if field_name in defaults and type_name in ("int", "float") \
                    and _out_of_range(defaults[field_name]):
                r.problem(field_line, f"event {key!r}: payload field {field_name!r}: default "
                                      f"{_show(defaults[field_name])} is out of range; numbers must "
                                      "be finite, above -2**63 and below 2**63")
                continue
            if defaults and field_name not in defaults:
                r.problem(field_line, f"event {key!r}: payload field {field_name!r} has no default "
                                      "but comes after one that has; list required fields first")
                continue
            payload[field_name] = type_name
        creates = r.flag(entry, "creates", line, f"event {key!r}")
        if creates and origin != "local":
            r.problem(line, f"event {key!r} creates transfers but its origin is {origin!r}; "
                            "only local events may create a transfer (a peer's message never does)")
        events[key] = EventSpec(key, origin, r.text(entry.get("doc"), line, "doc"), payload, creates,
                                line, defaults)

    def declared(section: str, list_key: str, allowed: set[str], what: str):
        """Entries of ``section``: ``name: doc`` (an empty ``list_key``) or a mapping with
        ``doc`` and ``list_key`` (field names). Yields (name, doc, names, entry, line)."""
        raw_section = r.mapping(raw, section, 1, required=False)
        for key, entry in raw_section.items():
            line = _line_of(raw_section, key, 1)
            if not valid_name(key, line, what):
                continue
            if entry is None or isinstance(entry, str):
                yield key, r.text(entry, line, f"{what} {key!r} doc"), (), _LineDict(), line
                continue
            if not isinstance(entry, dict):
                r.problem(line, f"{what} {key!r} must be a doc string or a mapping with doc and "
                                f"{list_key}, got {_kind(entry)}")
                continue
            for extra in entry:
                if extra not in allowed:
                    r.problem(_line_of(entry, extra, line), f"{what} {key!r}: unknown key "
                                                            f"{extra!r}; expected {', '.join(sorted(allowed))}")
            names: tuple[str, ...] = ()
            if list_key in entry and entry[list_key] not in (None, []):
                names = r.names(entry[list_key], _line_of(entry, list_key, line),
                                f"{what} {key!r} {list_key}")
            yield key, r.text(entry.get("doc"), line, f"{what} {key!r} doc"), names, entry, line

    fields_known = set(context) | set(config)
    guards: dict[str, GuardSpec] = {}
    for key, doc, reads, entry, line in declared("guards", "reads", {"doc", "reads"}, "guard"):
        for field_name in reads:
            if field_name not in fields_known:
                r.problem(_line_of(entry, "reads", line), f"guard {key!r} reads {field_name!r}, which is "
                                                          "neither a context field nor a config key")
        guards[key] = GuardSpec(key, doc, reads, line)
    actions: dict[str, ActionSpec] = {}
    for key, doc, writes, entry, line in declared("actions", "writes", {"doc", "writes"}, "action"):
        for field_name in writes:
            if field_name not in context:
                r.problem(_line_of(entry, "writes", line), f"action {key!r} writes {field_name!r}, which "
                                                           "is not a context field")
        actions[key] = ActionSpec(key, doc, writes, line)
    emits: dict[str, EmitSpec] = {}
    raw_emits = r.mapping(raw, "emits", 1, required=False)
    for key, entry in raw_emits.items():
        line = _line_of(raw_emits, key, 1)
        if not valid_name(key, line, "emit"):
            continue
        if not isinstance(entry, dict):
            r.problem(line, f"emit {key!r} must be a mapping with doc, fields and on_failure")
            continue
        for extra in entry:
            if extra not in ("doc", "fields", "on_failure"):
                r.problem(_line_of(entry, extra, line), f"emit {key!r}: unknown key {extra!r}; "
                                                        "expected doc, fields, on_failure")
        fields = entry.get("fields") or {}
        if not isinstance(fields, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                   for k in fields):
            r.problem(_line_of(entry, "fields", line), f"emit {key!r}: fields must map field "
                                                       "names to type names")
            fields = {}
        for field_name in [f for f in fields if f.startswith(RESERVED_PREFIX)]:
            r.problem(_line_of(fields, field_name, line),
                      f"emit {key!r}: " + reserved_message("emit field", field_name))
            del fields[field_name]
        for field_name, type_name in fields.items():
            if not isinstance(type_name, Hashable) or type_name not in FIELD_TYPES:
                r.problem(_line_of(fields, field_name, line),
                          f"emit {key!r}: field {field_name!r} has unknown type {_show(type_name)}; "
                          f"expected one of {', '.join(FIELD_TYPES)}")
        on_failure = r.name(entry.get("on_failure"), _line_of(entry, "on_failure", line),
                            f"emit {key!r} on_failure")
        if on_failure is not None and on_failure not in events:
            r.problem(_line_of(entry, "on_failure", line), f"emit {key!r}: on_failure names "
                                                           f"unknown event {on_failure!r}")
        emits[key] = EmitSpec(key, r.text(entry.get("doc"), line, f"emit {key!r} doc"),
                              {k: str(v) for k, v in fields.items()}, on_failure, line)

    initial = raw.get("initial")
    initial_line = _line_of(raw, "initial", 1)
    if not isinstance(initial, str):
        r.problem(initial_line, "missing 'initial' (expected the name of the initial state)")
        initial = ""
    elif initial not in states:
        r.problem(initial_line, f"unknown state {initial!r} given as initial; known states: {_listing(states)}")

    def check_state(state: str, line: int, where: str) -> None:
        if state not in states:
            r.problem(line, f"unknown state {state!r} in {where}; known states: {_listing(states)}")

    def check_event(event: str, line: int, where: str) -> None:
        if event not in events:
            r.problem(line, f"unknown event {event!r} in {where}; known events: {_listing(events)}")

    transitions: list[TransitionSpec] = []
    raw_transitions = raw.get("transitions")
    if raw_transitions is None:
        r.problem(_line_of(raw, "transitions", 1), "missing 'transitions' (expected a list)")
        raw_transitions = []
    elif not isinstance(raw_transitions, list):
        r.problem(_line_of(raw, "transitions", 1),
                  f"'transitions' must be a list, got {_kind(raw_transitions)}")
        raw_transitions = []
    allowed_keys = {"event", "source", "dest", "internal", "guard", "actions", "emits", "outcome"}
    for index, entry in enumerate(raw_transitions):
        line = _line_of(raw_transitions, index, 1)
        if not isinstance(entry, dict):
            r.problem(line, f"transition #{index} must be a mapping")
            continue
        for key in entry:
            if key == "effects":
                r.problem(_line_of(entry, key, line), f"transition #{index}: 'effects' is split "
                                                      "into 'actions' (context updates) and "
                                                      "'emits' (effect kinds)")
            elif key not in allowed_keys:
                r.problem(_line_of(entry, key, line), f"transition #{index}: unknown key {key!r}; "
                                                      f"expected {', '.join(sorted(allowed_keys))}")
        event = r.name(entry.get("event"), _line_of(entry, "event", line), f"transition #{index} event")
        if event is not None:
            check_event(event, _line_of(entry, "event", line), f"transition #{index}")
        source_line = _line_of(entry, "source", line)
        sources = r.names(entry.get("source"), source_line, f"transition #{index} source")
        for i, s in enumerate(sources):
            check_state(s, _line_of(entry.get("source"), i, source_line), f"transition #{index} source")
        if len(set(sources)) != len(sources):
            r.problem(source_line, f"transition #{index} lists a state twice in source")
        internal = r.flag(entry, "internal", line, f"transition #{index}")
        dest = r.name(entry.get("dest"), _line_of(entry, "dest", line), f"transition #{index} dest")
        if internal and dest is not None:
            r.problem(line, f"transition #{index} is internal and also names dest {dest!r}; choose one")
        if not internal and dest is None and entry.get("dest") is None:
            r.problem(line, f"transition #{index} needs a 'dest' state or 'internal: true'")
        if dest is not None:
            check_state(dest, _line_of(entry, "dest", line), f"transition #{index} dest")
        if entry.get("event") is None and internal:
            r.problem(line, f"transition #{index} is eventless and internal; an eventless "
                            "transition must change state or it would fire forever")
        guard = r.name(entry.get("guard"), _line_of(entry, "guard", line), f"transition #{index} guard")
        if guard is not None and guard not in guards:
            r.problem(_line_of(entry, "guard", line), f"unknown guard {guard!r} in transition #{index}; "
                                                      f"declare it under 'guards'")
        def row_names(key: str, declared_names: dict, section: str) -> tuple[str, ...]:
            raw_list = entry.get(key)
            list_line = _line_of(entry, key, line)
            names = (r.names(raw_list, list_line, f"transition #{index} {key}")
                     if raw_list not in (None, []) else ())
            for i, n in enumerate(names):
                if n not in declared_names:
                    r.problem(_line_of(raw_list, i, list_line), f"unknown {key[:-1]} {n!r} in "
                                                                f"transition #{index}; declare it "
                                                                f"under '{section}'")
            if len(set(names)) != len(names):
                r.problem(list_line, f"transition #{index} lists a {key[:-1]} twice in {key}")
            return names

        action_names = row_names("actions", actions, "actions")
        emit_names = row_names("emits", emits, "emits")
        outcome = entry.get("outcome", "applied")
        if outcome not in TRANSITION_OUTCOMES:
            r.problem(_line_of(entry, "outcome", line), f"transition #{index}: outcome must be one of "
                                                        f"{', '.join(TRANSITION_OUTCOMES)}, got {_show(outcome)}")
        if outcome != "applied" and (action_names or emit_names or not internal):
            r.problem(line, f"transition #{index} declares outcome {_show(outcome)}, which is only for "
                            "internal transitions without actions or emits")
        if emit_names and not action_names:
            r.problem(_line_of(entry, "emits", line), f"transition #{index} lists emits but no "
                                                      "action: effects are emitted by actions")
        transitions.append(TransitionSpec(index, event, sources, dest if not internal else None, guard,
                                          action_names, emit_names, outcome, line))

    timers: dict[str, TimerSpec] = {}
    raw_timers = r.mapping(raw, "timers", 1, required=False)
    for key, entry in raw_timers.items():
        line = _line_of(raw_timers, key, 1)
        if not valid_name(key, line, "timer"):
            continue
        if not isinstance(entry, dict):
            r.problem(line, f"timer {key!r} must be a mapping with states, duration and event")
            continue
        states_line = _line_of(entry, "states", line)
        t_states = r.names(entry.get("states"), states_line, f"timer {key!r} states")
        for i, s in enumerate(t_states):
            check_state(s, _line_of(entry.get("states"), i, states_line), f"timer {key!r}")
        duration = entry.get("duration")
        if not isinstance(duration, str) or duration not in config:
            r.problem(_line_of(entry, "duration", line), f"timer {key!r}: duration must name a config key, "
                                                         f"got {_show(duration)}; known: {_listing(config)}")
        event = entry.get("event")
        if not isinstance(event, str):
            r.problem(_line_of(entry, "event", line), f"timer {key!r} needs the 'event' it fires, "
                                                      f"as a name; got {_show(event)}")
            event = ""
        else:
            check_event(event, _line_of(entry, "event", line), f"timer {key!r}")
            if event in events and events[event].origin != "timer":
                r.problem(_line_of(entry, "event", line), f"timer {key!r} fires event {event!r}, "
                                                          "whose origin must be 'timer'")
        raw_restart = entry.get("restart_on")
        restart_line = _line_of(entry, "restart_on", line)
        restart = (r.names(raw_restart, restart_line, f"timer {key!r} restart_on")
                   if raw_restart not in (None, []) else ())
        for i, e in enumerate(restart):
            check_event(e, _line_of(raw_restart, i, restart_line), f"timer {key!r} restart_on")
        timers[key] = TimerSpec(key, t_states, str(duration), event, tuple(restart), line)

    invariants: list[InvariantSpec] = []
    raw_invariants = r.mapping(raw, "invariants", 1, required=False)
    for key, expr in raw_invariants.items():
        line = _line_of(raw_invariants, key, 1)
        if not valid_name(key, line, "invariant"):
            continue
        if not isinstance(expr, str):
            r.problem(line, f"invariant {key!r} must be an expression string")
            continue
        invariants.append(InvariantSpec(key, expr, line))

    if r.problems:
        raise SpecError(r.problems)
    return Spec(name=name, summary=summary, path=path, initial=initial, config=config,
                context=context, states=states, events=events, guards=guards, actions=actions,
                emits=emits,
                transitions=tuple(transitions), timers=timers, invariants=tuple(invariants))
