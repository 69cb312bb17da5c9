"""Diagrams: docs/ is up to date and fits a page, every row is drawn where it belongs, marks
and trace counts show, formats render."""

from __future__ import annotations

import re
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from moriio_fsm import diagrams
from moriio_fsm.cli import main
from moriio_fsm.diagrams.picture import picture
from moriio_fsm.lang.loader import parse_spec
from moriio_fsm.machines import MACHINE_MODULES, load_machine_spec, spec_path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "diagrams"
STALE = "out of date: run `moriio-fsm diagram --docs docs/diagrams` and commit the result"
#: The widest a docs picture may be, in pixels: it must read at README width.
README_WIDTH = 1000
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz's dot is not installed"
)


def png_chunks(data: bytes) -> list[tuple[bytes, bytes, int]]:
    """(type, data, stored CRC) of each chunk of a png, read by hand."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        chunks.append((kind, body, crc))
        at += 12 + length
    return chunks


def png_width(data: bytes) -> int:
    kind, body, _ = png_chunks(data)[0]
    assert kind == b"IHDR"
    return struct.unpack(">I", body[:4])[0]


# -- the docs ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MACHINE_MODULES))
def test_the_diagrams_in_docs_are_those_of_the_specs(name):
    spec = load_machine_spec(name)
    assert (DOCS / f"{name}.mmd").read_text() == diagrams.mermaid(spec), STALE
    digest = diagrams.source_digest(diagrams.dot(spec))
    for fmt in ("svg", "png"):
        assert diagrams.drawing_digest((DOCS / f"{name}.{fmt}").read_bytes()) == digest, STALE


def test_the_overview_in_docs_is_that_of_the_specs():
    digest = diagrams.source_digest(diagrams.overview_dot())
    for fmt in ("svg", "png"):
        assert diagrams.drawing_digest((DOCS / f"machines.{fmt}").read_bytes()) == digest, STALE


def test_every_docs_picture_fits_the_readme_width():
    pngs = sorted(DOCS.glob("*.png"))
    assert {p.stem for p in pngs} >= set(MACHINE_MODULES) | {"machines"}
    for path in pngs:
        width = png_width(path.read_bytes())
        assert 300 < width <= README_WIDTH, f"{path.name} is {width} px wide"


def test_the_machines_page_shows_the_write_producers_mermaid_diagram():
    text = diagrams.MACHINES_PAGE.read_text()
    block = diagrams.page_block(load_machine_spec("write_producer"))
    assert block in text, STALE
    assert diagrams.replace_page_block(text, block) == text


# -- what is drawn -------------------------------------------------------------------------


def drawn_rows(spec, pic):
    """(source, dest, trigger) of every row the picture shows; dest None: in the box."""
    found = []
    for box in pic.boxes.values():
        found += [(box.name, None, line.head()) for line in box.lines]
    for arrow in pic.arrows:
        for line in arrow.lines:
            trigger = re.sub(r" \(in [^)]*\)$", "", line.head())
            found += [(source, arrow.dest, trigger) for source in line.only_from or arrow.sources]
    return sorted(found, key=str)


def spec_rows(spec):
    expected = []
    for row in spec.transitions:
        if row.outcome != "applied":
            continue
        parts = ([row.event] if row.event else []) + ([f"[{row.guard}]"] if row.guard else [])
        head = " ".join(parts)
        for source in row.sources:
            moves = row.dest is not None and row.dest != source
            expected.append((source, row.dest if moves else None, head))
    return sorted(expected, key=str)


@pytest.mark.parametrize("name", sorted(MACHINE_MODULES))
@pytest.mark.parametrize("shared_tails", [True, False])
def test_every_applied_row_is_drawn_once_from_each_of_its_states(name, shared_tails):
    spec = load_machine_spec(name)
    pic = picture(spec, shared_tails=shared_tails)
    assert drawn_rows(spec, pic) == spec_rows(spec)
    pairs = [(s, a.dest) for a in pic.arrows for s in a.sources]
    assert len(pairs) == len(set(pairs)), "two arrows between the same two states"


def test_rows_that_keep_a_state_are_listed_in_it_and_parallel_moves_share_an_arrow(capsys):
    assert main(["diagram", "write_consumer"]) == 0
    out = capsys.readouterr().out
    assert "waiting : write_done [verdict_usable]" in out
    assert "waiting --> waiting" not in out and "stopping --> stopping" not in out
    (move,) = [line for line in out.splitlines() if line.startswith("  waiting --> stopping")]
    for trigger in ("request_finished", "write_timeout", "notify_failed", "[some_writer_failed]"):
        assert trigger in move
    assert "waiting : timer write_timeout after write_timeout_s" in out


def test_graphviz_marks_timers_and_joins_states_that_share_rows():
    source = diagrams.dot(load_machine_spec("write_consumer"))
    (timer,) = [line for line in source.splitlines() if '"stopping" -> "abandoned"' in line]
    assert "style=dashed" in timer and "safety_timeout" in timer
    assert "<I>write_timeout after write_timeout_s</I>" in source
    join = re.search(r'"waiting" -> ("__join\d+") \[arrowhead=none', source).group(1)
    assert f'"stopping" -> {join} [arrowhead=none' in source
    (shared,) = [line for line in source.splitlines() if f'{join} -> "quarantined"' in line]
    assert "[unconfirmed]" in shared and "hold_failed (in stopping)" in shared


def test_edges_carry_event_guard_and_effects_and_ends_are_marked(capsys):
    assert main(["diagram", "write_producer"]) == 0
    out = capsys.readouterr().out
    assert "sealed --> completed: [all_writes_succeeded] / send_write_done" in out
    assert 'state "quarantined (final, anomaly)" as quarantined' in out
    assert "class quarantined s_anomaly" in out and "released --> [*]" in out
    assert "(duplicate)" not in out
    assert main(["diagram", "write_producer", "--all-rows"]) == 0
    assert "(duplicate)" in capsys.readouterr().out
    every_row = diagrams.dot(load_machine_spec("write_producer"), all_rows=True)
    assert "(duplicate)" in every_row and "rows that change nothing" not in every_row


def test_a_trace_counts_transfers_per_edge_and_marks_stuck_states(stuck_trace, capsys):
    assert main(["diagram", "write_consumer", *[f"--trace={p}" for p in stuck_trace]]) == 0
    out = capsys.readouterr().out
    assert (
        "awaiting_allocation --> waiting: blocks_allocated [has_blocks] / send_remote_blocks x1"
        in out
    )
    assert 'state "waiting (1 stuck)" as waiting' in out and "class waiting s_stuck" in out
    assert main(["diagram", "write_producer", *[f"--trace={p}" for p in stuck_trace]]) == 0
    out = capsys.readouterr().out
    assert "sealed --> draining: " in out and "defer_timeout [awaiting_allocation] x1" in out
    spec = load_machine_spec("write_consumer")
    source = diagrams.dot(spec, usage=diagrams.usage_from_trace(stuck_trace, spec))
    assert "1 stuck" in source and "xN: transfers" in source


def test_the_overview_shows_each_machine_and_the_messages_it_gets():
    source = diagrams.overview_dot()
    # The four transfer machines; the watch's observers have pictures of their own.
    for name in ("write_producer", "write_consumer", "read_producer", "read_consumer"):
        spec = load_machine_spec(name)
        assert f'subgraph "cluster_{name}"' in source
        for state in spec.states:
            assert f'"{name}.{state}" [label=<{state}>' in source
    for heard in (
        "from D: remote_blocks, release",
        "from P: write_done, write_failed",
        "from D: heartbeat, release",
        "from P: lease_granted",
    ):
        assert heard in source


# -- formats and bad input -----------------------------------------------------------------


@needs_dot
@pytest.mark.parametrize(
    "fmt, magic", [("svg", b"<?xml"), ("png", b"\x89PNG"), ("dot", b"digraph")]
)
def test_graphviz_formats_render(tmp_path, fmt, magic):
    out = tmp_path / f"d.{fmt}"
    assert main(["diagram", "read_consumer", "-o", str(out)]) == 0
    assert out.read_bytes().startswith(magic)


@needs_dot
def test_a_marked_png_is_still_a_well_formed_png():
    spec = load_machine_spec("read_producer")
    drawn = diagrams.render(spec, "png")
    chunks = png_chunks(drawn)
    assert [kind for kind, _, _ in chunks[:2]] == [b"IHDR", b"tEXt"] and chunks[-1][0] == b"IEND"
    for kind, body, crc in chunks:
        assert zlib.crc32(kind + body) == crc, kind
    assert diagrams.drawing_digest(drawn) == diagrams.source_digest(diagrams.dot(spec))


@needs_dot
def test_the_overview_draws_to_a_file_at_readme_width(tmp_path, capsys):
    out = tmp_path / "machines.png"
    assert main(["diagram", "--overview", "-o", str(out)]) == 0
    assert png_width(out.read_bytes()) <= README_WIDTH
    assert main(["diagram", "--overview", "-f", "mermaid"]) == 2
    assert "svg, png, dot" in capsys.readouterr().err
    assert main(["diagram", "--overview", "write_producer"]) == 2
    assert "takes no SPEC" in capsys.readouterr().err


@needs_dot
def test_states_named_like_dot_keywords_and_an_odd_file_name_still_draw(tmp_path):
    text = Path(spec_path("read_producer")).read_text()
    for old, new in (("prefilling", "node"), ("leased", "edge"), ("aborted", "graph")):
        text = re.sub(rf"\b{old}\b", new, text)
    path = tmp_path / 'odd <b>&"name".yaml'
    path.write_text(text)
    spec = parse_spec(text, str(path))
    svg = diagrams.render(spec, "svg").decode()
    for state in ("node", "edge", "graph"):
        assert f">{state}</text>" in svg
    assert "&lt;b&gt;&amp;" in svg


def test_a_bad_spec_or_format_says_what_to_do(tmp_path, capsys):
    assert main(["diagram", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read spec" in capsys.readouterr().err
    assert main(["diagram", "write_producer", "-f", "png"]) == 2
    assert "pass -o FILE.png" in capsys.readouterr().err
    assert main(["diagram"]) == 2
    assert "--overview or --docs DIR" in capsys.readouterr().err
