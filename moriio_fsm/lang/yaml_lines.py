"""YAML read for a spec: every key and list item keeps its line, and what a spec never
needs is refused before it is built.

Rules: duplicate keys are collected (the reader reports them), not silently merged;
anchors and aliases, nesting deeper than ``MAX_NESTING`` and integers longer than
``MAX_INT_DIGITS`` are refused where they appear, so a small file cannot grow huge or
deep; syntax errors become one ``SpecError`` at their line. Values quoted back in
messages are cut short (``show``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Hashable
from typing import Any

import yaml

from .errors import Problem, SpecError
from .expr import show_int

#: How deep YAML collections may nest. A spec needs about six levels (top level,
#: transitions, a row, its sources); the composer and constructor recurse per level.
MAX_NESTING = 32
#: The longest integer literal read at all. Python refuses to convert more than 4300
#: digits (with a ValueError of its own); the loader's range checks report the rest.
MAX_INT_DIGITS = 4000


class _Refused(Exception):
    """A YAML construct a spec may not use, found while composing (line, message)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


class LineDict(dict):
    line: int = 0
    key_lines: dict[str, int]


class LineList(list):
    line: int = 0
    item_lines: list[int]


class LineLoader(yaml.SafeLoader):
    """SafeLoader that records 1-based lines, refuses duplicate keys, and refuses, before
    building them, anchors and aliases, nesting deeper than ``MAX_NESTING`` and integers
    longer than ``MAX_INT_DIGITS``."""

    duplicate_keys: list[tuple[int, str]]
    depth = 0

    def compose_node(self, parent, index):
        # The parser is iterative but the composer recurses once per level, so the depth
        # is checked here, before the next level is composed. Aliases are refused rather
        # than bounded: nine aliases of nine aliases of ... make a 1.5 KB file expand to
        # billions of nodes wherever a value is walked or quoted back in a message.
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(
                event.start_mark.line + 1,
                "anchors (&name) and aliases (*name) are not allowed in a spec: "
                "write the value out where it is used",
            )
        self.depth += 1
        try:
            if self.depth > MAX_NESTING:
                raise _Refused(
                    event.start_mark.line + 1,
                    f"lists and mappings are nested deeper than {MAX_NESTING} levels; "
                    "a spec needs about six",
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_INT_DIGITS:
            raise _Refused(
                node.start_mark.line + 1,
                f"integer of {len(node.value)} digits; numbers in a spec have at most "
                f"{MAX_INT_DIGITS} digits (and most must be below 2**63)",
            )
        return super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):
        result = LineDict()
        result.line = node.start_mark.line + 1
        result.key_lines = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "found a key that is a list or mapping; keys must be names",
                    key_node.start_mark,
                )
            if key in result:
                self.duplicate_keys.append((key_node.start_mark.line + 1, str(key)))
            result[key] = self.construct_object(value_node, deep=True)
            result.key_lines[key] = key_node.start_mark.line + 1
        return result

    def construct_sequence(self, node, deep=False):
        result = LineList(self.construct_object(child, deep=True) for child in node.value)
        result.line = node.start_mark.line + 1
        result.item_lines = [child.start_mark.line + 1 for child in node.value]
        return result


LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, LineLoader.construct_mapping
)
LineLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, LineLoader.construct_sequence
)
LineLoader.add_constructor("tag:yaml.org,2002:int", LineLoader.construct_yaml_int)


def read_yaml(text: str, path: str) -> tuple[Any, list[tuple[int, str]]]:
    """The YAML document of ``text`` (its mappings and lists with lines) and the
    ``(line, key)`` of every duplicate key; ``SpecError`` for invalid YAML and for what
    a spec may not use."""
    try:
        loader = LineLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise SpecError(
            [
                Problem(
                    path,
                    line,
                    f"invalid YAML: character {chr(exc.character)!r} is not allowed in a YAML file",
                )
            ]
        ) from None
    loader.duplicate_keys = []
    try:
        raw = loader.get_single_data()
    except _Refused as exc:
        raise SpecError([Problem(path, exc.line, exc.message)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise SpecError(
            [Problem(path, line, f"invalid YAML: {getattr(exc, 'problem', exc)}")]
        ) from None
    finally:
        loader.dispose()
    return raw, loader.duplicate_keys


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

    def repr_LineDict(self, x: dict, level: int) -> str:
        return self.repr_dict(x, level)

    def repr_LineList(self, x: list, level: int) -> str:
        return self.repr_list(x, level)


_repr = _ShortRepr()


def show(value: Any) -> str:
    """``repr(value)``, abbreviated (long strings, big ints and big lists are cut)."""
    return _repr.repr(value)


def kind_of(value: Any) -> str:
    """The YAML word for a value's type, for messages ("mapping", "list", "str")."""
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def line_of(container: Any, key: Any, default: int) -> int:
    """The line of ``container[key]``, or ``default`` (the owner's line) when it is absent."""
    if isinstance(container, LineDict):
        return container.key_lines.get(key, default)
    if isinstance(container, LineList) and isinstance(key, int) and key < len(container.item_lines):
        return container.item_lines[key]
    return default
