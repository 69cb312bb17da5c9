"""Diagrams: docs/ is up to date, marks and trace counts show, formats render."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moriio_fsm import diagrams
from moriio_fsm.cli import main
from moriio_fsm.machines import MACHINE_MODULES, load_machine_spec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "diagrams"
STALE = "out of date: run `moriio-fsm diagram --docs docs/diagrams` and commit the result"


@pytest.mark.parametrize("name", sorted(MACHINE_MODULES))
def test_the_diagrams_in_docs_are_those_of_the_specs(name):
    spec = load_machine_spec(name)
    assert (DOCS / f"{name}.mmd").read_text() == diagrams.mermaid(spec), STALE
    svg = (DOCS / f"{name}.svg").read_bytes()
    assert diagrams.svg_digest(svg) == diagrams.source_digest(diagrams.dot(spec)), STALE


def test_the_readme_shows_the_write_producers_mermaid_diagram():
    text = diagrams.README.read_text()
    block = diagrams.readme_block(load_machine_spec("write_producer"))
    assert block in text, STALE
    assert diagrams.replace_readme_block(text, block) == text


def test_edges_carry_event_guard_and_effects_and_ends_are_marked(capsys):
    assert main(["diagram", "write_producer"]) == 0
    out = capsys.readouterr().out
    assert "sealed --> completed: [all_writes_succeeded] / send_write_done" in out
    assert 'state "quarantined [final, anomaly]" as quarantined' in out
    assert "class quarantined s_anomaly" in out and "released --> [*]" in out
    assert "(duplicate)" not in out
    assert main(["diagram", "write_producer", "--all-rows"]) == 0
    assert "(duplicate)" in capsys.readouterr().out


def test_a_trace_counts_transfers_per_edge_and_marks_stuck_states(stuck_trace, capsys):
    assert main(["diagram", "write_consumer", *[f"--trace={p}" for p in stuck_trace]]) == 0
    out = capsys.readouterr().out
    assert "awaiting_allocation --> waiting: blocks_allocated [has_blocks] / send_remote_blocks x1" in out
    assert 'state "waiting [1 stuck]" as waiting' in out and "class waiting s_stuck" in out
    assert main(["diagram", "write_producer", *[f"--trace={p}" for p in stuck_trace]]) == 0
    out = capsys.readouterr().out
    assert "sealed --> draining: " in out and "defer_timeout [awaiting_allocation] x1" in out


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
@pytest.mark.parametrize("fmt, magic", [("svg", b"<?xml"), ("png", b"\x89PNG"), ("dot", b"digraph")])
def test_graphviz_formats_render(tmp_path, fmt, magic):
    out = tmp_path / f"d.{fmt}"
    assert main(["diagram", "read_consumer", "-o", str(out)]) == 0
    assert out.read_bytes().startswith(magic)


def test_a_bad_spec_or_format_says_what_to_do(tmp_path, capsys):
    assert main(["diagram", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read spec" in capsys.readouterr().err
    assert main(["diagram", "write_producer", "-f", "png"]) == 2
    assert "pass -o FILE.png" in capsys.readouterr().err
