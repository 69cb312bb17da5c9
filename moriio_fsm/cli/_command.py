"""How a subcommand module adds its parser: the help texts come from the module's docstring.

A subcommand module's docstring starts with "``moriio-fsm NAME``: SUMMARY", one paragraph:
SUMMARY is its line in ``moriio-fsm --help``; the paragraphs after it are the description
``moriio-fsm NAME --help`` shows. So a command's documentation and its help cannot drift.
"""

from __future__ import annotations

import argparse
import re

_LITERAL = re.compile(r"``(.+?)``", re.S)


def _folded(text: str) -> str:
    return " ".join(_LITERAL.sub(r"\1", text).split())


def add_command(sub, name: str, doc: str | None) -> argparse.ArgumentParser:
    """Add subcommand ``name`` to ``sub`` (``add_subparsers``' result), helped by ``doc``.

    ``doc`` None (``python -OO`` drops docstrings) adds the command without help texts;
    a docstring that does not start with "``moriio-fsm NAME``:" raises ``ValueError``.
    """
    if doc is None:
        return sub.add_parser(name)
    first, _, rest = doc.strip().partition("\n\n")
    prefix = f"``moriio-fsm {name}``:"
    if not first.startswith(prefix):
        raise ValueError(
            f"the docstring of subcommand {name!r} must start with {prefix!r} "
            f"and its one-paragraph summary; it starts {first[:60]!r}"
        )
    summary = _folded(first[len(prefix) :]).removesuffix(".")
    return sub.add_parser(name, help=summary, description=_folded(rest) or None)
