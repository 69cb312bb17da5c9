"""``moriio-fsm check`` as a user runs it: summaries, counterexamples, traces, exit codes."""

from __future__ import annotations

import json

import pytest

from moriio_fsm.cli import main
from moriio_fsm.machines import spec_path
from moriio_fsm.trace import read_trace, replay

SAFETY_TIMER = """  safety:
    states: [stopping]
    duration: safety_timeout_s
    event: safety_timeout
"""


@pytest.fixture
def timerless(tmp_path):
    """A copy of write_consumer without its safety timer (it can wait forever)."""
    text = spec_path("write_consumer").read_text()
    assert SAFETY_TIMER in text
    path = tmp_path / "write_consumer.yaml"
    path.write_text(text.replace(SAFETY_TIMER, ""))
    return path


def test_a_sound_spec_prints_its_counts_and_exits_0(capsys):
    assert main(["check", "read_producer", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("read_producer: ok: ")
    assert " states, " in out and " transitions, " in out and out.rstrip().endswith(" s")


def test_a_broken_spec_prints_a_counterexample_and_writes_a_trace_replay_accepts(
    timerless, tmp_path, capsys
):
    out_dir = tmp_path / "out"
    assert main(["check", str(timerless), "--layers", "1", "--out", str(out_dir)]) == 1
    out = capsys.readouterr().out
    assert "write_consumer: FAILED" in out
    assert "broken: ends_without_peer:" in out and "'stopping'" in out
    assert "shortest counterexample (" in out and "1. t=0  write_consumer <- receive_started" in out
    [trace_path] = out_dir.glob("counterexample-*.jsonl")
    assert str(trace_path) in out
    trace = read_trace(trace_path)
    assert [s.event for s in trace.steps][0] == "receive_started"
    report = replay([str(trace_path)])
    assert not report.divergences  # every recorded step comes out again
    assert any(a.kind == "not_final" for a in report.anomalies)


def test_json_output_lists_each_finding_with_its_steps_and_trace(timerless, tmp_path, capsys):
    code = main(
        [
            "check",
            str(timerless),
            "read_producer",
            "--layers",
            "1",
            "--json",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 1
    results = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in results] == ["write_consumer", "read_producer"]
    broken, sound = results
    assert not broken["ok"] and sound["ok"] and sound["findings"] == []
    [finding] = broken["findings"]
    assert finding["rule"] == "ends_without_peer"
    assert finding["steps"][0].startswith("t=0  write_consumer <- receive_started")
    assert finding["trace"].endswith(".jsonl")
    assert broken["states"] > 0 and broken["transitions"] >= broken["states"]


def test_pairs_are_named_pair_write_and_pair_read(capsys):
    assert main(["check", "pair:write", "--layers", "1", "--faults", "0", "--tick", "off"]) == 0
    assert capsys.readouterr().out.startswith("write pair (write_producer x write_consumer): ok")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["check", "write_consumr"], "unknown SPEC 'write_consumr'"),
        (
            ["check", "read_producer", "--layers", "0"],
            "bound layers must be an integer in [1, 16], got 0",
        ),
        (
            ["check", "read_producer", "--config", "read_producer.lease_s"],
            "--config takes MACHINE.KEY=VALUE",
        ),
        (
            ["check", "read_producer", "--config", "read_producer.lease=3"],
            "unknown config key 'lease'",
        ),
        (["check", "read_producer", "--config", "read_producer.lease_s=-1"], "must be a positive"),
        (["check", "read_producer", "--spec", "write_consumer=x.yaml"], "no pair checked here"),
    ],
)
def test_bad_usage_says_what_was_expected_and_exits_2(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_a_spec_file_that_does_not_load_reports_file_and_line(tmp_path, capsys):
    path = tmp_path / "write_consumer.yaml"
    path.write_text(
        spec_path("write_consumer").read_text().replace("dest: received,", "dest: recieved,")
    )
    assert main(["check", str(path)]) == 2
    assert f"{path}:" in capsys.readouterr().err


def test_bad_tick_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["check", "read_producer", "--tick", "soon"])
    assert stop.value.code == 2
    assert "expected seconds, auto or off" in capsys.readouterr().err
