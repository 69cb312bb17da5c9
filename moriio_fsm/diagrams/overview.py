"""The four shipped machines in one picture: a row per mode (WRITE, READ), a column per side
(producer P, consumer D), and the messages each side sends the other.

Rules: derived from the specs alone. A machine shows its states and the moves between them
(events are left to each spec's own picture); a message is an effect ``send_<x>`` of one
side that the other side declares as its remote event ``<x>``.
"""

from __future__ import annotations

from html import escape

from ..lang.model import Spec
from ..trace.facts import message_event
from .to_dot import FILLS, FONT, quoted

MODES = ("write", "read")
SIDES = (("producer", "P, the prefill side"), ("consumer", "D, the decode side"))
MESSAGE_COLOUR = "#7f3f98"


def overview_source(specs: dict[str, Spec]) -> str:
    """Dot source of the overview of ``specs`` (by name: ``write_producer``...)."""
    lines = [
        "digraph machines {",
        (
            "  graph [rankdir=TB, compound=true, newrank=true, nodesep=0.12, ranksep=0.25, "
            f'fontname="{FONT}", fontsize=11, pad=0.15, labelloc=t, label=<{_title()}>];'
        ),
        (
            f'  node [shape=box, style="rounded,filled", fontname="{FONT}", fontsize=10, '
            'margin="0.04,0.02", height=0.28];'
        ),
        '  edge [arrowsize=0.5, color="#555555"];',
    ]
    for mode in MODES:
        producer, consumer = specs[f"{mode}_producer"], specs[f"{mode}_consumer"]
        lines += _cluster(producer, SIDES[0][1], _sent(consumer, producer), "D")
        lines += _cluster(consumer, SIDES[1][1], _sent(producer, consumer), "P")
    lines += _grid(specs)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _title() -> str:
    lines = [
        (
            "One machine per mode and side, one transfer each. Arrows: its state moves (the "
            "events are in each spec's own picture)."
        ),
        (
            "Purple: the messages it gets from the other side. Double border: final state; "
            "red: anomaly."
        ),
    ]
    return '<FONT POINT-SIZE="15"><B>The four transfer machines</B></FONT><BR/>' + "".join(
        f'<FONT POINT-SIZE="10">{escape(line)}</FONT><BR/>' for line in lines
    )


def _node(spec: Spec, state: str) -> str:
    """The dot ID of a state of one machine (state names repeat across machines)."""
    return quoted(f"{spec.name}.{state}")


def _cluster(spec: Spec, words: str, received: list[str], sender: str) -> list[str]:
    mode = spec.name.split("_")[0].upper()
    heard = escape(f"from {sender}: {', '.join(received)}")
    lines = [
        f"  subgraph {quoted('cluster_' + spec.name)} {{",
        (
            f"    label=<<B>{escape(spec.name)}</B><BR/>{mode}, {escape(words)}<BR/>"
            f'<FONT COLOR="{MESSAGE_COLOUR}">{heard}</FONT>>; '
            'style="rounded"; color="#888888"; fontsize=11;'
        ),
        f'    {_node(spec, "__start")} [shape=point, width=0.1, label=""];',
        f"    {_node(spec, '__start')} -> {_node(spec, spec.initial)} [weight=10];",
    ]
    for name, state in spec.states.items():
        kind = "anomaly" if state.anomaly else "final" if state.final else ""
        fill, border = FILLS[kind]
        extra = ", peripheries=2" if state.final else ""
        lines.append(
            f'    {_node(spec, name)} [label=<{escape(name)}>, fillcolor="{fill}", '
            f'color="{border}"{extra}];'
        )
    moves = dict.fromkeys(
        (source, row.dest)
        for row in spec.transitions
        if row.outcome == "applied" and row.dest is not None
        for source in row.sources
        if source != row.dest
    )
    lines += [f"    {_node(spec, source)} -> {_node(spec, dest)};" for source, dest in moves]
    lines.append("  }")
    return lines


def _sent(sender: Spec, receiver: Spec) -> list[str]:
    """The messages ``sender`` sends ``receiver``: its effects send_<x> where <x> is a
    remote event of ``receiver``."""
    remote = {e.name for e in receiver.events.values() if e.origin == "remote"}
    names = [message_event(kind) for kind in sender.emits]
    return [name for name in names if name in remote]


def _grid(specs: dict[str, Spec]) -> list[str]:
    """Both sides of a mode start on one rank; the READ row starts below the WRITE row."""
    lines = []
    for mode in MODES:
        starts = " ".join(_node(specs[f"{mode}_{side}"], "__start") for side, _ in SIDES)
        lines.append(f"  {{rank=same; {starts}}}")
    for side, _ in SIDES:
        above, below = specs[f"write_{side}"], specs[f"read_{side}"]
        for name in above.final_states:
            lines.append(
                f"  {_node(above, name)} -> {_node(below, '__start')} [style=invis, weight=0];"
            )
    # Pull the READ producer under the WRITE producer, so the two rows line up: of the
    # four, the WRITE producer has the most states in a row, so its finals are lowest and
    # this edge pulls sideways only.
    above, below = specs["write_producer"], specs["read_producer"]
    middle = above.final_states[len(above.final_states) // 2]
    lines.append(f"  {_node(above, middle)} -> {_node(below, '__start')} [style=invis, weight=3];")
    return lines
