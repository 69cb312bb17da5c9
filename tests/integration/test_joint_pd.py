"""P and D machines of both modes together: drivers, an in-memory channel and stand-in
RDMA, heterogeneous TP, and faults (deaths, lost, duplicated, reordered and late
messages, failed and hung operations, teardowns never confirmed, failed handshakes).

Whatever happens, at the end every transfer of a live node is final, no block went back
twice or while an operation from or into it was in flight, and no write or read touched
blocks that had gone back. Runs are seeded: a failure names its seed and shows the log.
"""

from __future__ import annotations

import pytest

from moriio_fsm.sim.pd import Layout, run
from moriio_fsm.sim.world import Faults

LAYOUTS = {"1P-1D": Layout(1, 1), "1P-2D": Layout(1, 2), "2P-1D": Layout(2, 1)}
FAULTS = {
    "none": Faults(),
    "lossy-channel": Faults(lose=0.1, duplicate=0.1, late=0.1),
    "rdma": Faults(fail_op=0.1, hang_op=0.05, mute_teardown=0.3, fail_handshake=0.1),
    "everything": Faults(
        lose=0.05,
        duplicate=0.05,
        late=0.05,
        fail_op=0.05,
        hang_op=0.03,
        mute_teardown=0.2,
        fail_handshake=0.05,
    ),
}


def explain(report) -> str:
    return (
        f"seed {report.seed}: not final {report.not_final[:8]}, violations "
        f"{report.violations[:8]}\n" + "\n".join(report.log[-60:])
    )


def test_without_faults_every_transfer_completes_on_both_sides():
    for name, layout in LAYOUTS.items():
        report = run(3, layout, transfers=12)
        assert report.ok, explain(report)
        ended = report.ended
        # Some transfers are aborted on purpose; all others complete.
        assert set(ended["write_consumer"]) <= {"received", "released", "failed"}, name
        assert ended["read_consumer"].get("received", 0) >= 1, name
        assert (
            "abandoned" not in ended["write_consumer"]
            and "quarantined" not in ended["write_producer"]
        )


def test_each_producer_rank_drives_its_own_transfers():
    """Two P ranks writing to two D ranks: each P rank's layers, seal and end go to its
    own transfer (they once all went to the last rank's, leaving P0's and D0's unfinished)."""
    report = run(3, Layout(2, 2), transfers=6, abort_rate=0.0)
    assert report.ok, explain(report)
    assert report.ended["write_producer"] == {"released": 6}
    assert report.ended["write_consumer"] == {"received": 6}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("faults", sorted(FAULTS))
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_every_transfer_ends_and_no_block_is_misused(layout, faults, seed):
    report = run(seed, LAYOUTS[layout], FAULTS[faults], transfers=16, deaths=seed % 2)
    assert report.ok, explain(report)


def test_a_run_is_reproduced_exactly_by_its_seed():
    first = run(5, Layout(2, 1), FAULTS["everything"], transfers=10, deaths=1)
    second = run(5, Layout(2, 1), FAULTS["everything"], transfers=10, deaths=1)
    assert first.log == second.log and first.ended == second.ended


def test_a_producer_that_frees_its_blocks_on_abort_is_caught(tmp_path):
    """A negative control: upstream's bug (P frees its blocks on abort while writes from
    them may be in flight), planted in a copy of the spec, must show up as violations."""
    from moriio_fsm.machines import spec_path

    text = spec_path("write_producer").read_text()
    row = """  - {event: abort, source: [allocated, scheduling, sealed], dest: draining,
     actions: [mark_request_finished, end_aborted]}"""
    assert row in text
    broken = text.replace(
        row,
        """  - {event: abort, source: [allocated, scheduling, sealed], dest: aborted,
     actions: [mark_request_finished, end_aborted, free_blocks], emits: [free_blocks]}""",
    )
    path = tmp_path / "write_producer.yaml"
    path.write_text(broken)
    found = []
    for seed in range(6):
        report = run(
            seed, Layout(1, 1), transfers=12, abort_rate=0.6, specs={"write_producer": str(path)}
        )
        found.extend(report.violations)
    assert any(
        v.startswith("freed_under_operation: ") and "free_blocks while write of layer" in v
        for v in found
    ), found[:5]
