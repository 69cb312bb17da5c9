"""explain and the cross-side anomalies on a stuck transfer: D waits for a writer that expired."""

from __future__ import annotations

from moriio_fsm.cli import main
from moriio_fsm.trace import replay


def test_a_stuck_transfer_is_explained_in_one_command(stuck_trace, capsys):
    assert main(["explain", *map(str, stuck_trace), "--transfer", "tx-0"]) == 1
    out = capsys.readouterr().out
    assert "transfer 'tx-0': 24 steps on 3 side(s) (D0, P0, P1)" in out
    assert "defer_timeout          applied   sealed -> expired" in out
    why = next(line for line in out.splitlines() if line.startswith("why: "))
    assert "D0/write_consumer 'tx-0' is stuck in 'waiting'" in why
    assert "it waits for write_done or write_failed from 2 peer(s)" in why
    assert "1 arrived (write_done from P0)" in why
    assert (
        "P1's trace shows its transfer 'tx-0>d0' ended 'expired' at t=6.000 and sent "
        "write_failed at t=6.000, which never arrived"
    ) in why
    assert "write timer fires write_timeout at t=12.015, after the trace ends" in why


def test_either_sides_id_finds_the_whole_request(stuck_trace, capsys):
    assert main(["explain", *map(str, stuck_trace), "--transfer", "tx-0>d0"]) == 1
    out = capsys.readouterr().out
    assert "on 3 side(s)" in out and "why: P0/write_producer 'tx-0>d0' ended 'released'" in out


def test_replay_reports_the_stuck_side_and_the_verdict_that_never_arrived(stuck_trace):
    report = replay(stuck_trace)
    assert not report.divergences
    found = {(a.kind, a.where) for a in report.anomalies}
    assert found == {
        ("not_final", "D0/write_consumer 'tx-0'"),
        ("unmatched", "P1/write_producer 'tx-0>d0'"),
    }
    unmatched = next(a for a in report.anomalies if a.kind == "unmatched")
    assert (
        "sent write_failed at t=6.000 but no other side's trace shows it arriving"
        in unmatched.message
    )


def test_an_unknown_transfer_says_so(stuck_trace, capsys):
    assert main(["explain", *map(str, stuck_trace), "--transfer", "nope"]) == 1
    assert "no step of it" in capsys.readouterr().out
