"""Replay: a clean trace reproduces, a tampered one is caught and named, P and D merge."""

from __future__ import annotations

import json

from moriio_fsm.cli import main
from moriio_fsm.runtime.declared import events
from moriio_fsm.sim.pd import Layout, link, run
from moriio_fsm.trace import TraceRecorder, replay, trace_events, write_trace

from .conftest import close_all, traced_pd


def test_the_demo_trace_reproduces_with_both_executors(demo_trace):
    for executor in ("compiled", "transitions"):
        report = replay([demo_trace], executor=executor)
        assert report.compared == report.steps == 71 and not report.divergences
        # The demo's unconfirmed teardown ends quarantined: an anomaly by its spec.
        assert [(a.kind, a.transfer) for a in report.anomalies] == [
            ("anomaly_state", "tx-demo-unconfirmed_teardown")
        ]


def test_the_executor_option_and_its_old_name_engine(demo_trace, capsys):
    assert main(["replay", str(demo_trace), "--executor", "transitions", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["executor"] == "transitions" and captured.err == ""
    # Old scripts keep working: --engine is still taken, with a one-line note on stderr.
    assert main(["replay", str(demo_trace), "--engine", "transitions", "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["executor"] == data["engine"] == "transitions"
    assert captured.err.count("\n") == 1 and "renamed --executor" in captured.err
    assert (
        main(["replay", str(demo_trace), "--engine", "compiled", "--executor", "transitions"]) == 2
    )
    assert "disagree" in capsys.readouterr().err
    assert main(["replay", str(demo_trace)]) == 1
    assert "with the compiled executor" in capsys.readouterr().out


def _tamper(path, match: str, old: str, new: str, transfer: str = ""):
    lines = path.read_text().splitlines()
    index = next(
        i for i, line in enumerate(lines) if match in line and old in line and transfer in line
    )
    lines[index] = lines[index].replace(old, new, 1)
    path.write_text("\n".join(lines) + "\n")
    return index + 1


def test_a_tampered_state_is_caught_with_a_nonzero_exit_and_named(demo_trace, capsys):
    line = _tamper(demo_trace, '"event":"seal"', '"after":"sealed"', '"after":"completed"')
    assert main(["replay", str(demo_trace)]) == 1
    out = capsys.readouterr().out
    assert f"FIRST DIVERGENCE: {demo_trace}:{line}: " in out
    assert (
        "transfer 'tx-demo-clean', event seal at t=0.200000: recorded state after "
        "'completed', the replay gives 'sealed'" in out
    )
    assert "the transfer's steps before it:" in out and "layer_scheduled" in out
    assert "result: diverged" in out


def test_tampered_actions_and_effects_are_caught(demo_trace):
    _tamper(
        demo_trace,
        '"event":"seal"',
        '"actions":["fix_expected"]',
        '"actions":["fix_nothing"]',
        transfer="tx-demo-failed_write",
    )
    _tamper(demo_trace, "post_write", '"layer":0', '"layer":5', transfer="tx-demo-clean")
    whats = {d.what for d in replay([demo_trace]).divergences}
    assert whats == {"actions", "effects"}


def test_filters_replay_one_transfer_or_stop_at_a_seq(demo_trace, capsys):
    report = replay([demo_trace], transfer="tx-demo-aborted")
    assert {s.transfer for s in report.transfers.values()} == {"tx-demo-aborted"}
    assert report.ok
    assert main(["replay", str(demo_trace), "--until", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["compared"] == 3
    assert data["live"] == [
        {
            "side": "demo",
            "table": "write_producer",
            "transfer": "tx-demo-clean",
            "state": "scheduling",
        }
    ]


def _traced_run(folder, layout: Layout, seed: int):
    recorders = {}

    def recorder_for(node: str) -> TraceRecorder:
        recorders[node] = TraceRecorder(
            node, file=folder / f"{node}.jsonl", link=link, virtual_time=True
        )
        return recorders[node]

    sim_report = run(seed, layout, transfers=6, abort_rate=0.0, recorders=recorder_for)
    return sim_report, close_all(recorders)


def test_p_and_d_traces_of_a_joint_run_merge_and_replay_clean(tmp_path):
    sim_report, files = _traced_run(tmp_path, Layout(p=2, d=1), seed=11)
    assert sim_report.ok and [f.stem for f in files] == ["D0", "P0", "P1"]
    report = replay(files)
    assert sorted(report.sides) == ["D0", "P0", "P1"]
    assert report.compared == report.steps > 100
    assert not report.divergences and not report.anomalies, report.anomalies[:3]
    assert {s.link for s in report.transfers.values()} == {f"tx-{i}" for i in range(6)}


def test_what_the_sim_finds_unfinished_the_replay_finds_too(tmp_path):
    pd, recorders = traced_pd(tmp_path, Layout(p=2, d=2), seed=11)
    pd.start_write("tx-0")
    pd.start_read("tx-1")
    pd.world.run(until=0.005, tick=0.05)  # stopped while layers are still to come
    sim_report = pd.report()
    files = close_all(recorders)
    assert len(sim_report.not_final) == 6  # P0, P1, D0, D1 write; P0, P1 read
    report = replay(files)
    assert not report.divergences
    stuck = {
        f"{a.where.split(' ')[0]}/{a.transfer}" for a in report.anomalies if a.kind == "not_final"
    }
    assert stuck == set(sim_report.not_final)


def test_a_once_only_effect_emitted_twice_is_an_anomaly(tmp_path):
    tables, steps = trace_events(
        "write_producer",
        [
            events.prefill_started("tx-1", 0.0, 1),
            events.remote_blocks("tx-1", 0.0, [7], 0),
            events.layer_scheduled("tx-1", 0.1, 0),
            events.seal("tx-1", 0.2),
            events.layer_write_completed("tx-1", 0.3, 0),
        ],
    )
    done = steps[-1]
    assert [e["kind"] for e in done.effects] == ["send_write_done"]
    # A second writer of the same id (a restarted process reusing it) said it again.
    twice = [
        *steps,
        *(
            s.__class__(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "seq": s.seq + 100})
            for s in steps
        ),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(path, [*tables, *twice])
    kinds = {a.kind for a in replay([path]).anomalies}
    assert "twice" in kinds


def test_the_checker_api_writes_traces_replay_accepts(tmp_path):
    tables, steps = trace_events(
        "write_consumer",
        [
            events.receive_started("tx-1", 0.0, 1),
            events.blocks_allocated("tx-1", 0.1, [1, 2]),
            events.write_done("tx-1", 0.2, producer_rank=0),
        ],
    )
    path = tmp_path / "counterexample.jsonl"
    write_trace(path, [*tables, *steps])
    report = replay([path])
    assert report.ok and report.compared == 3
    assert steps[-1].after == "received"


def test_a_hand_written_payload_may_leave_out_fields_that_have_defaults(tmp_path):
    tables, steps = trace_events(
        "write_producer",
        [events.prefill_started("tx-1", 0.0, 1), events.remote_blocks("tx-1", 0.1, [7], 0)],
    )
    assert steps[1].data == {
        "block_ids": [7],
        "decode_rank": 0,
        "req_id": "",
        "prompt_digest": "",
        "decode_dp_rank": -1,
    }
    short = steps[1].__class__(
        **{
            **{f: getattr(steps[1], f) for f in steps[1].__struct_fields__},
            "data": {"block_ids": [7], "decode_rank": 0},
        }
    )
    path = tmp_path / "t.jsonl"
    write_trace(path, [*tables, steps[0], short])
    assert replay([path]).compared == 2 and not replay([path]).divergences


def test_replay_offers_every_executor_a_table_has():
    from moriio_fsm.cli.replay import EXECUTORS as offered
    from moriio_fsm.runtime.table import EXECUTORS

    assert offered == EXECUTORS
