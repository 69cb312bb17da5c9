"""The sections that name code: guards (the fields each reads), actions (the fields each
writes) and invariants (expressions over the context).

Rules: a reader records each problem on the ``SpecReader`` with its line and never raises;
a guard reads only context fields or config keys, an action writes only context fields.
"""

from __future__ import annotations

from .model import ActionSpec, GuardSpec, InvariantSpec
from .spec_reader import SpecReader
from .yaml_lines import kind_of, line_of


def read_declared(
    r: SpecReader,
    raw: dict,
    section: str,
    list_key: str,
    what: str,
    known: set[str] | dict,
    unknown_is: str,
):
    """Entries of ``section`` (guards, actions): ``name: doc`` or a mapping with ``doc``
    and ``list_key`` (field names, each of which must be in ``known``; one that is not is
    reported as ``unknown_is``). Yields ``(name, doc, names, line)``."""
    allowed = {"doc", list_key}
    for key, entry, line in r.entries(raw, section, what):
        if entry is None or isinstance(entry, str):
            yield key, r.text(entry, line, f"{what} {key!r} doc"), (), line
            continue
        if not isinstance(entry, dict):
            r.problem(
                line,
                f"{what} {key!r} must be a doc string or a mapping with doc and "
                f"{list_key}, got {kind_of(entry)}",
            )
            continue
        r.unknown_keys(entry, allowed, line, f"{what} {key!r}", ", ".join(sorted(allowed)))
        names: tuple[str, ...] = ()
        if list_key in entry and entry[list_key] not in (None, []):
            names = r.names(
                entry[list_key], line_of(entry, list_key, line), f"{what} {key!r} {list_key}"
            )
        doc = r.text(entry.get("doc"), line, f"{what} {key!r} doc")
        for field_name in names:
            if field_name not in known:
                r.problem(
                    line_of(entry, list_key, line),
                    f"{what} {key!r} {list_key} {field_name!r}, which is {unknown_is}",
                )
        yield key, doc, names, line


def read_guards(r: SpecReader, raw: dict, fields_known: set[str]) -> dict[str, GuardSpec]:
    return {
        key: GuardSpec(key, doc, reads, line)
        for key, doc, reads, line in read_declared(
            r,
            raw,
            "guards",
            "reads",
            "guard",
            fields_known,
            "neither a context field nor a config key",
        )
    }


def read_actions(r: SpecReader, raw: dict, context: dict) -> dict[str, ActionSpec]:
    return {
        key: ActionSpec(key, doc, writes, line)
        for key, doc, writes, line in read_declared(
            r, raw, "actions", "writes", "action", context, "not a context field"
        )
    }


def read_invariants(r: SpecReader, raw: dict) -> list[InvariantSpec]:
    invariants: list[InvariantSpec] = []
    for key, expr, line in r.entries(raw, "invariants", "invariant"):
        if not isinstance(expr, str):
            r.problem(line, f"invariant {key!r} must be an expression string")
            continue
        invariants.append(InvariantSpec(key, expr, line))
    return invariants
