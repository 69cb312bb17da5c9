"""The chaos run at small N: the whole stack under every fault at once must leave no
transfer unfinished and no block misused, reproducibly; and it must notice when a spec
does misuse blocks or leaves transfers waiting (negative controls)."""

from __future__ import annotations

import re

import pytest

from moriio_fsm.chaos import ChaosSettings, ChaosUsageError, run_chaos
from moriio_fsm.cli import main
from moriio_fsm.machines import spec_path

LINE = re.compile(
    r"transfers=(\d+) completed=(\d+) failed=(\d+) not_final=(\d+) "
    r"double_handback=(\d+) freed_in_flight=(\d+)"
)


def planted(tmp_path, name: str, old: str, new: str) -> str:
    text = spec_path(name).read_text()
    assert old in text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace(old, new))
    return str(path)


def test_under_every_fault_every_transfer_ends_and_no_block_is_misused():
    result = run_chaos(ChaosSettings(transfers=400, seed=7, fault_rate=0.05))
    assert result.ok, (result.line(), result.examples, result.stuck)
    assert result.completed + result.failed + result.not_final == 400
    assert result.completed > 100 and result.failed > 0  # the faults did bite
    assert result.crashed
    faults = result.faults
    assert all(
        faults[k] > 0
        for k in (
            "rdma_failed",
            "rdma_stalled",
            "messages_lost",
            "messages_duplicated",
            "messages_delayed",
        )
    )
    assert faults["undecodable"] == 0


def test_without_faults_every_transfer_completes():
    result = run_chaos(ChaosSettings(transfers=120, seed=1, fault_rate=0.0))
    assert result.line() == (
        "transfers=120 completed=120 failed=0 not_final=0 double_handback=0 freed_in_flight=0"
    )
    assert not result.crashed


def test_a_seed_replays_the_same_run():
    first = run_chaos(ChaosSettings(transfers=150, seed=11, fault_rate=0.1))
    second = run_chaos(ChaosSettings(transfers=150, seed=11, fault_rate=0.1))
    other = run_chaos(ChaosSettings(transfers=150, seed=12, fault_rate=0.1))
    assert (first.line(), first.faults, first.crashed) == (
        second.line(),
        second.faults,
        second.crashed,
    )
    assert (first.line(), first.faults) != (other.line(), other.faults)


def test_a_producer_that_frees_on_abort_under_its_writes_is_caught(tmp_path):
    row = (
        "  - {event: abort, source: [allocated, scheduling, sealed], dest: draining,\n"
        "     actions: [mark_request_finished, end_aborted]}"
    )
    path = planted(
        tmp_path,
        "write_producer",
        row,
        "  - {event: abort, source: [allocated, scheduling, sealed], dest: aborted,\n"
        "     actions: [mark_request_finished, end_aborted, free_blocks], "
        "emits: [free_blocks]}",
    )
    result = run_chaos(
        ChaosSettings(transfers=300, seed=3, fault_rate=0.1), specs={"write_producer": path}
    )
    assert result.freed_in_flight > 0
    assert any(
        e.startswith("freed_under_operation: ") and "free_blocks while write of layer" in e
        for e in result.examples
    )


def test_a_consumer_without_its_safety_timer_is_caught_waiting(tmp_path):
    timer = (
        "  safety:\n    states: [stopping]\n    duration: safety_timeout_s\n"
        "    event: safety_timeout\n"
    )
    path = planted(tmp_path, "write_consumer", timer, "")
    result = run_chaos(
        ChaosSettings(transfers=300, seed=3, fault_rate=0.1), specs={"write_consumer": path}
    )
    assert result.not_final > 0
    assert any("in 'stopping'" in s for s in result.stuck)


def test_the_command_prints_the_verdict_line_last(capsys):
    assert main(["chaos", "--transfers", "60", "--seed", "2", "--fault-rate", "0.05"]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    match = LINE.fullmatch(lines[-1])
    assert match and match.group(1) == "60"
    assert [int(n) for n in match.groups()[3:]] == [0, 0, 0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["chaos", "--transfers", "0"], "transfers must be an integer in [1, 10000000], got 0"),
        (["chaos", "--fault-rate", "0.9"], "fault_rate must be a number in [0, 0.5], got 0.9"),
        (["chaos", "--layers", "100"], "layers must be an integer in [1, 64], got 100"),
    ],
)
def test_bad_settings_say_what_was_expected(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_settings_refuse_what_they_cannot_take():
    with pytest.raises(ChaosUsageError, match="seed must be an integer"):
        ChaosSettings(seed="x")
