"""The pieces of generated source that come from a spec: names, comments, literals.

Rules: nothing of a spec's path or names becomes code. In a comment it is one line of
printable text; in code it is a ``repr`` literal or an ASCII identifier; a field name
that cannot be an attribute, and a number that is not finite, are refused with
``ValueError`` naming what was expected.
"""

from __future__ import annotations

import keyword
import math
import unicodedata
from typing import Any

#: The test that a value is NOT of a declared field type (``value_fits``, inverted, inline).
TYPE_TESTS = {
    "int": "type({0}) is not int",
    "float": "type({0}) is not float and type({0}) is not int",
    "bool": "type({0}) is not bool",
    "str": "not isinstance({0}, str)",
    "list": "not isinstance({0}, (list, tuple))",
    "tuple": "not isinstance({0}, tuple)",
    "any": "",
}


def ident(name: str) -> str:
    """``name`` as part of a Python name: ASCII letters, digits and underscores only.
    (Python folds other letters to their NFKC form, so two distinct names such as
    U+FB01 "ﬁ" and "fi" would become one.)"""
    return "".join(c if (c.isascii() and c.isalnum()) or c == "_" else "_" for c in str(name))


def one_line(value: Any) -> str:
    """``value`` as text for a comment of the generated module: one line, whatever it
    holds. Every character that is not printable (line breaks, U+2028, NUL...) is written
    as its escape, so nothing of a path or a name can end the comment."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def attribute_name(name: Any) -> str:
    """A context or payload field name, checked before it is written as an attribute:
    an identifier that is not a keyword and that Python does not fold to another name."""
    if (
        not isinstance(name, str)
        or not name.isidentifier()
        or keyword.iskeyword(name)
        or unicodedata.normalize("NFKC", name) != name
    ):
        raise ValueError(
            f"field name {name!r} cannot be an attribute in generated code; "
            "expected an identifier, not a keyword, in its NFKC form"
        )
    return name


def number_literal(value: Any, what: str) -> str:
    """A finite int or float as a literal of the generated module."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(
            f"{what} must be a finite number to be written into generated code, got {value!r}"
        )
    return repr(value)


def index_literal(value: Any, what: str) -> int:
    if type(value) is not int:
        raise ValueError(f"{what} must be an int to be written into generated code, got {value!r}")
    return value
