"""A picture as Graphviz dot source, drawn top to bottom so that it fits a page's width.

Rules: the source depends on the spec (and the trace's counts) alone, never on paths or
dates, so its digest tells whether a drawing is current. Labels are wrapped (``ARROW_WRAP``,
``BOX_WRAP``) so that a label is never much wider than a state; a timer's rows are blue and
its arrows dashed; the title says what the marks mean and what is left to the spec.
"""

from __future__ import annotations

import re
import textwrap
from html import escape

from .picture import Arrow, Box, Line, Picture

#: Characters per line of an arrow's label and of a box's line. Arrows' labels sit side
#: by side between two rows of states, so they are narrow; boxes are stacked, so they
#: may be wider. With these a spec's picture stays under ~1000 px at 96 dpi.
ARROW_WRAP = 26
BOX_WRAP = 40
FONT = "Helvetica"
NO_BREAK = "\u00a0"  # textwrap breaks at ASCII whitespace only
TIMER_COLOUR = "#1f4e9c"
MUTED = "#555555"
#: (fill, border) of a state by what it is; a stuck state shows before anything else.
FILLS = {
    "stuck": ("#ffe599", "#b45f06"),
    "anomaly": ("#f4cccc", "#990000"),
    "final": ("#d9ead3", "#38761d"),
    "": ("white", "black"),
}
LEGEND = (
    "An arrow's line: event [guard] / effects; [guard] alone: as soon as the guard "
    "holds. Blue, dashed: a timer's event. In a box: the timers armed there (italic), "
    "then the rows that keep the state. Double border: final; red: anomaly. Not drawn: "
    "actions, row order, what restarts a timer{unchanged} (see {spec_file})."
)
COUNTS = " xN: transfers of the trace that took the row; yellow: states where transfers were left."


def quoted(name: str) -> str:
    """A dot ID for a name (a state called ``node`` or ``edge`` must not read as a keyword)."""
    return '"' + name.replace('"', '\\"') + '"'


def dot_source(pic: Picture) -> str:
    lines = [
        f"digraph {quoted(pic.name)} {{",
        *_graph_attributes(pic),
        '  "__start" [shape=point, width=0.12, label=""];',
        f'  "__start" -> {quoted(pic.initial)};',
    ]
    lines += [f"  {quoted(box.name)} [{_box_attributes(box)}];" for box in pic.boxes.values()]
    # Labels have a white ground and the biggest are drawn last: an arrow that dot routes
    # across another's label passes under it instead of through its words.
    numbered = sorted(enumerate(pic.arrows), key=lambda item: _size(item[1]))
    for number, arrow in numbered:
        lines += _arrow(arrow, quoted(f"__join{number}"))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _graph_attributes(pic: Picture) -> list[str]:
    unchanged = "" if pic.all_rows else ", rows that change nothing"
    legend = LEGEND.format(spec_file=pic.spec_file, unchanged=unchanged)
    legend += COUNTS if pic.counted else ""
    text = "<BR/>".join(escape(part) for part in textwrap.wrap(legend, 110))
    title = f'<FONT POINT-SIZE="14"><B>{escape(pic.name)}</B></FONT><BR/>{text}'
    return [
        (
            f'  graph [rankdir=TB, nodesep=0.15, ranksep=0.3, fontname="{FONT}", '
            f"fontsize=10, pad=0.15, labelloc=t, label=<{title}>];"
        ),
        (
            f'  node [shape=box, style="rounded,filled", fontname="{FONT}", fontsize=10, '
            'margin="0.06,0.03"];'
        ),
        f'  edge [fontname="{FONT}", fontsize=9, arrowsize=0.6, color="#333333"];',
    ]


def _box_attributes(box: Box) -> str:
    fill, border = FILLS[box.kind]
    rows = [f"<TR><TD><B>{escape(box.name)}</B></TD></TR>"]
    if box.role:
        rows.append(
            f'<TR><TD><FONT POINT-SIZE="8" COLOR="{border}">{escape(box.role)}</FONT></TD></TR>'
        )
    timers = [(text, TIMER_COLOUR, True) for timer in box.timers for text in _wrap(timer, BOX_WRAP)]
    kept = [
        (text, TIMER_COLOUR if line.timer else MUTED, False)
        for line in box.lines
        for text in _wrap(line.text(), BOX_WRAP)
    ]
    for section in (timers, kept):
        rows += [_row(*row, rule=number == 0) for number, row in enumerate(section)]
    table = (
        '<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="1">'
        + "".join(rows)
        + "</TABLE>"
    )
    # Live states share a group, so dot keeps them in one column and the arrows between
    # them straight: the picture grows down, not sideways.
    shape = ", peripheries=2" if box.final else ", group=live"
    return f'label=<{table}>, fillcolor="{fill}", color="{border}"{shape}'


def _row(text: str, colour: str, italic: bool, rule: bool) -> str:
    """One line of a box; the first of a section has a light rule above it."""
    text = f"<I>{escape(text)}</I>" if italic else escape(text)
    border = ' BORDER="1" SIDES="T" COLOR="#bbbbbb"' if rule else ""
    return (
        f'<TR><TD ALIGN="LEFT"{border}><FONT POINT-SIZE="9" COLOR="{colour}">{text}'
        "</FONT></TD></TR>"
    )


def _arrow(arrow: Arrow, join: str) -> list[str]:
    style = f', style=dashed, color="{TIMER_COLOUR}"' if arrow.timer_only else ""
    label = f"label=<{_label(arrow.lines)}>{style}"
    dest = quoted(arrow.dest)
    if len(arrow.sources) == 1:
        return [f"  {quoted(arrow.sources[0])} -> {dest} [{label}];"]
    # Several states share these rows: their arrows meet in a point and go on as one.
    lines = [f'  {join} [shape=point, width=0.05, label=""];']
    lines += [f"  {quoted(source)} -> {join} [arrowhead=none{style}];" for source in arrow.sources]
    lines.append(f"  {join} -> {dest} [{label}];")
    return lines


def _size(arrow: Arrow) -> int:
    return sum(len(_wrap(line.text(), ARROW_WRAP)) for line in arrow.lines)


def _label(lines: list[Line]) -> str:
    parts = []
    for line in lines:
        text = "<BR/>".join(escape(t) for t in _wrap(line.text(), ARROW_WRAP))
        if line.timer:
            text = f'<FONT COLOR="{TIMER_COLOUR}">{text}</FONT>'
        parts.append(text)
    return (
        '<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="2" '
        f'BGCOLOR="white"><TR><TD BALIGN="LEFT">{"<BR/>".join(parts)}</TD></TR></TABLE>'
    )


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most ``width`` characters, broken between words (a name longer than
    ``width`` keeps its own line, and so does ``(in a, b)``); continuation lines are
    indented."""
    kept = re.sub(r"\(in [^)]*\)", lambda m: m.group(0).replace(" ", NO_BREAK), text)
    lines = textwrap.wrap(
        kept, width, subsequent_indent="   ", break_long_words=False, break_on_hyphens=False
    ) or [kept]
    return [line.replace(NO_BREAK, " ") for line in lines]
