"""The connector's traces: each side's file replays cleanly, and explain tells one transfer's story.

Both instances write every step of their machines (``trace_file``); merged, P's and D's
traces replay with no divergence and no anomaly, and ``moriio-fsm explain`` shows the
transfer on both sides. A transfer that ends badly lands in the dump file too.
"""

from __future__ import annotations

import pytest
from harness import PROMPT_FOR_METRICS, run_until, write_pair_params

from moriio_fsm.cli import main as cli
from moriio_fsm.trace import read_trace, replay

pytestmark = pytest.mark.integration


def traced(make_instance, tmp_path, name, role, **extra):
    return make_instance(
        name,
        role,
        extra={
            "trace_file": str(tmp_path / "{engine_id}.jsonl"),
            "trace_dump_file": str(tmp_path / "{engine_id}-dump.jsonl"),
            **extra,
        },
    )


def test_both_sides_traces_replay_cleanly_and_explain_the_transfer(make_instance, tmp_path, capsys):
    P, D = (
        traced(make_instance, tmp_path, "P", "kv_producer"),
        traced(make_instance, tmp_path, "D", "kv_consumer"),
    )
    to_p, to_d = write_pair_params("tx-t1", P, D)
    P.add("p-1", PROMPT_FOR_METRICS, 1, to_p)
    D.add("d-1", PROMPT_FOR_METRICS, 3, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= 3 and P.empty() and D.empty())
    P.close()
    D.close()
    files = [str(tmp_path / "P.jsonl"), str(tmp_path / "D.jsonl")]
    kinds = {step.event for f in files for step in read_trace(f).steps}
    assert {
        "prefill_started",
        "remote_blocks",
        "layer_write_completed",
        "write_done",
        "blocks_allocated",
    } <= kinds
    report = replay(files)
    assert report.ok, report
    assert cli(["replay", *files]) == 0
    capsys.readouterr()
    assert cli(["explain", *files, "--transfer", "tx-t1"]) == 0
    out = capsys.readouterr().out
    assert "tx-t1" in out and "write_done" in out and "remote_blocks" in out


def test_a_transfer_that_fails_is_dumped(make_instance, tmp_path):
    D = traced(
        make_instance,
        tmp_path,
        "D",
        "kv_consumer",
        machine_config={
            "write_consumer": {"write_timeout_s": 0.3, "safety_timeout_s": 0.6},
            # P's drain, which D's safety timeout must outlast, as short (D runs no P here)
            "write_producer": {"transfer_timeout_s": 0.2, "abandon_timeout_s": 0.2},
        },
    )
    D.scheduler.recompute_kv_load_failures = True
    D.add(
        "d-1",
        PROMPT_FOR_METRICS,
        2,
        {
            "do_remote_prefill": True,
            "transfer_id": "tx-t2",
            "remote_host": "127.0.0.1",
            "remote_notify_port": 9,
            "remote_handshake_port": 9,
        },
    )
    assert run_until([D], lambda: len(D.outputs.get("d-1", [])) >= 2 and D.empty(), 20)
    D.close()
    dumped = read_trace(str(tmp_path / "D-dump.jsonl")).steps
    assert dumped and {step.transfer for step in dumped} == {"tx-t2"}
    assert dumped[-1].after in ("failed", "quarantined", "abandoned")
