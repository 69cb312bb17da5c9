"""A picture as a mermaid ``stateDiagram-v2`` (GitHub draws it; nothing to install).

Rules: the same boxes as the Graphviz drawing, a box's timers and the rows that keep its
state being its description lines; arrows have one tail each (mermaid has no junction
point; see ``picture(shared_tails=False)``), an arrow's rows separated by ``<br/>``.
Mermaid ends a description at ``:`` or ``;``, and no spec name can hold either.
"""

from __future__ import annotations

from .picture import Picture

STYLES = {
    "final": "fill:#d9ead3,color:black",
    "anomaly": "fill:#f4cccc,color:#990000",
    "stuck": "fill:#ffe599,color:#b45f06",
}


def mermaid_source(pic: Picture) -> str:
    lines = ["---", f"title: {pic.name}", "---", "stateDiagram-v2"]
    lines += [f"  classDef s_{name} {style}" for name, style in STYLES.items()]
    lines.append(f"  [*] --> {pic.initial}")
    for box in pic.boxes.values():
        if box.role:
            lines.append(f'  state "{box.name} ({box.role})" as {box.name}')
        lines += [f"  {box.name} : timer {timer}" for timer in box.timers]
        lines += [f"  {box.name} : {line.text()}" for line in box.lines]
    for arrow in pic.arrows:
        label = "<br/>".join(line.text() for line in arrow.lines)
        lines += [f"  {source} --> {arrow.dest}: {label}" for source in arrow.sources]
    lines += [f"  class {box.name} s_{box.kind}" for box in pic.boxes.values() if box.kind]
    lines += [f"  {box.name} --> [*]" for box in pic.boxes.values() if box.final]
    return "\n".join(lines) + "\n"
