"""Drawing a spec, or the four shipped machines, in one format: the one entry point that
runs Graphviz.

Rules: mermaid and dot are text made here; svg and png are Graphviz's drawing of the dot
source, marked with the source's digest. A missing Graphviz is a ``DiagramError`` that
says what to install.
"""

from __future__ import annotations

from ..lang.model import Spec
from .overview import overview_source
from .picture import picture
from .stamps import stamp
from .to_dot import dot_source
from .to_mermaid import mermaid_source
from .usage import Usage

FORMATS = ("svg", "png", "dot", "mermaid")
#: The overview is laid out by Graphviz only (mermaid cannot place four machines).
OVERVIEW_FORMATS = ("svg", "png", "dot")


class DiagramError(ValueError):
    """A diagram cannot be drawn (an unknown format, Graphviz's binaries are missing...)."""


def mermaid(spec: Spec, *, usage: Usage | None = None, all_rows: bool = False) -> str:
    # Mermaid has no junction point: one arrow per pair of states.
    return mermaid_source(picture(spec, usage=usage, all_rows=all_rows, shared_tails=False))


def dot(spec: Spec, *, usage: Usage | None = None, all_rows: bool = False) -> str:
    return dot_source(picture(spec, usage=usage, all_rows=all_rows))


def overview_dot(specs: dict[str, Spec] | None = None) -> str:
    """Dot source of the four machines (the shipped specs unless ``specs`` is given)."""
    if specs is None:
        from ..machines import MACHINE_MODULES, load_machine_spec

        specs = {name: load_machine_spec(name) for name in MACHINE_MODULES}
    return overview_source(specs)


def render(spec: Spec, fmt: str, *, usage: Usage | None = None, all_rows: bool = False) -> bytes:
    """The diagram of ``spec`` in ``fmt`` (one of ``FORMATS``), as bytes."""
    if fmt not in FORMATS:
        raise DiagramError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "mermaid":
        return mermaid(spec, usage=usage, all_rows=all_rows).encode()
    return draw(dot(spec, usage=usage, all_rows=all_rows), fmt)


def render_overview(fmt: str) -> bytes:
    """The four shipped machines in one picture, in ``fmt`` (one of ``OVERVIEW_FORMATS``)."""
    if fmt not in OVERVIEW_FORMATS:
        raise DiagramError(f"the overview is drawn as {', '.join(OVERVIEW_FORMATS)}; got {fmt!r}")
    return draw(overview_dot(), fmt)


def draw(source: str, fmt: str) -> bytes:
    """Dot ``source`` drawn by Graphviz as ``fmt`` (svg, png; dot returns the source),
    marked with the source's digest."""
    if fmt == "dot":
        return source.encode()
    try:
        import graphviz
    except ImportError:
        raise DiagramError(
            "svg and png need the graphviz Python package (pip install "
            "graphviz); mermaid and dot need nothing"
        ) from None
    try:
        drawn = graphviz.Source(source).pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        raise DiagramError(
            f"{fmt} needs Graphviz's dot program: apt-get install graphviz "
            "(or draw -f mermaid or -f dot)"
        ) from None
    return stamp(drawn, source)
