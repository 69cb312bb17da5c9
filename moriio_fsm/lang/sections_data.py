"""The sections of what a machine holds: config keys (with their bounds), context fields
and states.

Rules: a reader records each problem on the ``SpecReader`` with its line and never raises;
a config key or context field is checked against the names declared before it.
"""

from __future__ import annotations

from .model import CONTEXT_TYPES, ConfigKey, ConfigRef, ContextField, StateSpec
from .spec_reader import MAX_INT, SpecReader, out_of_range
from .yaml_lines import line_of, show

CONFIG_KEYS = ("default", "doc", "exceeds")


def read_config(r: SpecReader, raw: dict) -> dict[str, ConfigKey]:
    config: dict[str, ConfigKey] = {}
    for key, entry, line in r.entries(raw, "config", "config key", attribute=True):
        # A key with a bad default is still declared, so that a timer naming it is not
        # reported too (the spec is refused either way).
        if not isinstance(entry, dict) or "default" not in entry:
            r.problem(line, f"config key {key!r} must be a mapping with a 'default'")
            config[key] = ConfigKey(key, None, "", line)
            continue
        default = entry["default"]
        if (
            isinstance(default, bool)
            or not isinstance(default, (int, float))
            or not 0 < default < MAX_INT
        ):
            r.problem(
                line,
                f"config key {key!r}: default must be a positive finite number "
                f"below 2**63 (a duration or a limit), got {show(default)}",
            )
        r.unknown_keys(entry, CONFIG_KEYS, line, f"config key {key!r}", ", ".join(CONFIG_KEYS))
        config[key] = ConfigKey(
            key,
            default,
            r.text(entry.get("doc"), line, "doc"),
            line,
            read_exceeds(r, key, entry, line),
        )
    return config


def read_exceeds(r: SpecReader, key: str, entry: dict, line: int) -> tuple[ConfigRef, ...]:
    """The bound of config key ``key``: a list of ``machine.key`` names. Whether each
    names a known machine and key is the loader's check across specs (``bounds.py``)."""
    if "exceeds" not in entry:
        return ()
    raw = entry["exceeds"]
    where = f"config key {key!r}: exceeds"
    exceeds_line = line_of(entry, "exceeds", line)
    if not isinstance(raw, list) or not raw:
        r.problem(
            exceeds_line,
            f"{where} must be a non-empty list of MACHINE.KEY names (the "
            f"keys whose sum this key must exceed), got {show(raw)}",
        )
        return ()
    refs: list[ConfigRef] = []
    for i, item in enumerate(raw):
        item_line = line_of(raw, i, exceeds_line)
        machine, dot, name = item.partition(".") if isinstance(item, str) else ("", "", "")
        if not (dot and machine.isidentifier() and name.isidentifier()):
            r.problem(
                item_line,
                f"{where}: {show(item)} is not MACHINE.KEY (a machine's name, "
                "a dot and one of its config keys)",
            )
        elif any((ref.machine, ref.key) == (machine, name) for ref in refs):
            r.problem(item_line, f"{where} names {item!r} twice")
        else:
            refs.append(ConfigRef(machine, name, item_line))
    return tuple(refs)


def read_context(r: SpecReader, raw: dict, config: dict) -> dict[str, ContextField]:
    context: dict[str, ContextField] = {}
    for key, entry, line in r.entries(raw, "context", "context field", attribute=True):
        if key in config:
            r.problem(
                line, f"context field {key!r} has the name of a config key; names must differ"
            )
            continue
        ftype = entry.get("type") if isinstance(entry, dict) else None
        if not isinstance(ftype, str) or ftype not in CONTEXT_TYPES:
            r.problem(
                line,
                f"context field {key!r} needs a type, one of {', '.join(CONTEXT_TYPES)}; "
                f"got {show(ftype)}",
            )
            continue
        initial = entry.get("initial")
        if initial is None and ftype != "object":
            r.problem(line, f"context field {key!r} of type {ftype} needs an 'initial' value")
        elif (
            initial is not None
            and not isinstance(initial, CONTEXT_TYPES[ftype])
            or (ftype in ("int", "bitmap", "float") and isinstance(initial, bool))
        ):
            r.problem(
                line, f"context field {key!r}: initial value {show(initial)} is not of type {ftype}"
            )
        elif ftype != "object" and out_of_range(initial):
            r.problem(
                line,
                f"context field {key!r}: initial value {show(initial)} is out of "
                "range; numbers must be finite, above -2**63 and below 2**63",
            )
        context[key] = ContextField(
            key, ftype, initial, r.text(entry.get("doc"), line, "doc"), line
        )
    return context


def read_states(r: SpecReader, raw: dict) -> dict[str, StateSpec]:
    states: dict[str, StateSpec] = {}
    for key, entry, line in r.entries(raw, "states", "state", required=True):
        entry = entry if isinstance(entry, dict) else {}
        r.unknown_keys(
            entry, ("doc", "final", "anomaly"), line, f"state {key!r}", "doc, final, anomaly"
        )
        final = r.flag(entry, "final", line, f"state {key!r}")
        anomaly = r.flag(entry, "anomaly", line, f"state {key!r}")
        if anomaly and not final:
            r.problem(
                line_of(entry, "anomaly", line),
                f"state {key!r} is marked anomaly but is "
                "not final; only a final state can be an anomaly",
            )
        states[key] = StateSpec(key, r.text(entry.get("doc"), line, "doc"), final, line, anomaly)
    return states
