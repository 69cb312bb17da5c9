"""State diagrams of specs, in Graphviz (svg, png, dot) or mermaid, and the four shipped
machines in one overview.

Rules: a diagram is derived from the spec alone: ``picture`` decides what is shown,
``to_dot`` and ``to_mermaid`` how. Given a trace's usage (``usage_from_trace``) each row
says how many transfers took it and states where transfers were left are highlighted.
svg and png need Debian's ``graphviz`` binaries; dot and mermaid need nothing. Every svg
and png is marked with the digest of its dot source (``stamps``).
``python -m moriio_fsm.diagrams DIR`` (or ``moriio-fsm diagram --docs DIR``) regenerates
the drawings in the docs and docs/machines.md's WRITE producer diagram.
"""

from __future__ import annotations

from .docs import MACHINES_PAGE, page_block, replace_page_block, write_docs
from .drawing import (
    FORMATS,
    OVERVIEW_FORMATS,
    DiagramError,
    dot,
    draw,
    mermaid,
    overview_dot,
    render,
    render_overview,
)
from .stamps import drawing_digest, source_digest
from .usage import Usage, usage_from_trace

__all__ = [
    "FORMATS",
    "MACHINES_PAGE",
    "OVERVIEW_FORMATS",
    "DiagramError",
    "Usage",
    "dot",
    "draw",
    "drawing_digest",
    "mermaid",
    "overview_dot",
    "page_block",
    "render",
    "render_overview",
    "replace_page_block",
    "source_digest",
    "usage_from_trace",
    "write_docs",
]
