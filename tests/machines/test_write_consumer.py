"""The WRITE consumer (D) under every ordering and failure its spec promises to handle.

The rule that matters most: D never lets its blocks be reused (reported, freed) while a
write of P into them may still land, and D never waits forever.
"""

from __future__ import annotations

import pytest

from moriio_fsm.runtime.events import Outcome

BLOCKS = [3, 4, 5]


def started(side, writers: int = 1, **config):
    d = side("write_consumer", **config)
    assert d.send("receive_started", num_writers=writers).outcome is Outcome.CREATED
    r = d.send("blocks_allocated", block_ids=BLOCKS, req_id="req-d-7")
    assert r.state == "waiting"
    [announce] = r.effects
    assert announce.kind == "send_remote_blocks" and announce.block_ids == BLOCKS
    assert announce.req_id == "req-d-7"
    return d


def test_one_writer_done_reports_the_load_once(side):
    d = started(side)
    r = d.send("write_done", producer_rank=0)
    assert r.state == "received"
    assert d.kinds() == ["send_remote_blocks", "report_received"]
    assert d.send("write_done", producer_rank=0).outcome is Outcome.LATE


def test_fan_in_waits_for_every_writer_and_ignores_repeats(side):
    d = started(side, writers=2)
    assert d.send("write_done", producer_rank=1).state == "waiting"
    assert d.send("write_done", producer_rank=1).outcome is Outcome.DUPLICATE
    assert d.state == "waiting" and not d.kinds("report_received")
    assert d.send("write_done", producer_rank=0).state == "received"
    assert len(d.kinds("report_received")) == 1


def test_unranked_writers_are_counted_so_an_upstream_p_still_completes(side):
    d = started(side, writers=2)
    d.send("write_done")
    assert d.state == "waiting"
    d.send("write_done")
    assert d.state == "received"


def test_a_failed_writer_makes_d_release_the_others_and_wait_until_they_stopped(side):
    d = started(side, writers=2)
    r = d.send("write_failed", producer_rank=0, reason="failed", writes_stopped=True)
    assert r.state == "stopping"
    assert d.kinds() == ["send_remote_blocks", "send_release"]
    assert not d.kinds("report_load_failure")  # writer 1 may still be writing
    r = d.send("write_done", producer_rank=1)  # it finished before it saw the release
    assert r.state == "failed"
    [failure] = d.kinds("report_load_failure")
    assert failure.reason == "failed"


def test_a_writer_that_cannot_confirm_its_writes_stopped_quarantines_the_blocks(side):
    d = started(side)
    r = d.send("write_failed", producer_rank=0, reason="failed", writes_stopped=False)
    assert r.state == "quarantined"
    assert d.kinds()[-2:] == ["quarantine_blocks", "report_load_failure"]
    assert not d.kinds("free_blocks")
    assert d.table.stats()["anomalies"] == 1


def test_d_never_waits_forever_when_p_goes_silent(side):
    d = started(side, writers=1, write_timeout_s=10.0, safety_timeout_s=5.0)
    d.advance(9.0)
    assert d.state == "waiting"
    d.advance(2.0)  # D's own timeout
    assert d.state == "stopping" and len(d.kinds("send_release")) == 1
    d.advance(6.0)  # nobody confirmed: quarantine
    assert d.state == "abandoned"
    [failure] = d.kinds("report_load_failure")
    assert failure.reason == "safety_timeout"
    assert d.table.stats()["anomalies"] == 1


def test_a_safety_timeout_keeps_the_blocks_out_of_circulation_rather_than_free_them(side):
    """Silence proves nothing: P may never have heard the release and write later."""
    d = started(side, writers=1, safety_timeout_s=5.0)
    d.send("request_finished")  # blocks held, release sent
    d.advance(6.0)
    assert d.state == "abandoned"
    assert len(d.kinds("quarantine_blocks")) == 1
    assert not d.kinds("free_blocks") and not d.kinds("report_load_failure")


def test_d_repeats_its_release_until_every_writer_confirmed(side):
    """A lost release (or a lost answer) is asked again every release_repeat_s."""
    d = started(side, writers=1, safety_timeout_s=60.0, release_repeat_s=10.0)
    d.send("request_finished")
    assert len(d.kinds("send_release")) == 1
    d.advance(10.5)
    d.advance(10.5)
    assert d.state == "stopping" and len(d.kinds("send_release")) == 3
    assert d.record.release_sent == 1  # the first release, counted once
    r = d.send("write_failed", producer_rank=0, reason="ended", writes_stopped=True)
    assert r.state == "released" and len(d.kinds("free_blocks")) == 1
    d.advance(30.0)
    assert len(d.kinds("send_release")) == 3  # ended: nothing more is asked


def test_d_stops_repeating_after_max_release_repeats_and_the_safety_timeout_decides(side):
    d = started(side, safety_timeout_s=60.0, release_repeat_s=10.0, max_release_repeats=2)
    d.send("request_finished")
    for _ in range(5):
        d.advance(10.5)
    assert d.state == "stopping" and len(d.kinds("send_release")) == 3  # the first + 2
    d.advance(10.0)
    assert d.state == "abandoned"


def test_a_late_write_done_after_d_timed_out_still_completes_the_load(side):
    d = started(side, writers=1, write_timeout_s=10.0)
    d.advance(11.0)
    assert d.state == "stopping"
    r = d.send("write_done", producer_rank=0)
    assert r.state == "received" and d.kinds("report_received")


def test_progress_from_a_writer_pushes_ds_deadline_back(side):
    d = started(side, writers=2, write_timeout_s=10.0)
    d.advance(8.0)
    d.send("write_done", producer_rank=0)
    d.advance(8.0)
    assert d.state == "waiting"
    d.advance(3.0)
    assert d.state == "stopping"


def test_the_request_ending_while_p_writes_holds_the_blocks_until_p_stopped(side):
    d = started(side)
    r = d.send("request_finished")
    assert r.state == "stopping"
    assert [e.kind for e in r.effects] == ["hold_blocks", "send_release"]
    assert not d.kinds("free_blocks")
    r = d.send("write_failed", producer_rank=0, reason="released", writes_stopped=True)
    assert r.state == "released"
    [freed] = d.kinds("free_blocks")
    assert not d.kinds("report_load_failure") and not d.kinds("report_received")


def test_the_request_ending_before_allocation_releases_p_and_holds_nothing(side):
    d = side("write_consumer")
    d.send("receive_started", num_writers=2)
    r = d.send("request_finished")
    assert r.state == "released"
    assert d.kinds() == ["send_release"]


def test_nothing_to_load_releases_p_at_once(side):
    d = side("write_consumer")
    d.send("receive_started", num_writers=1)
    r = d.send("blocks_allocated", block_ids=[])
    assert r.state == "released" and d.kinds() == ["send_release"]


def test_remote_blocks_that_could_not_be_sent_stop_the_transfer_safely(side):
    d = started(side, writers=2, safety_timeout_s=5.0)
    r = d.send("notify_failed", error="outbox full")
    assert r.state == "stopping" and d.kinds("send_release")
    d.advance(6.0)
    assert d.state == "abandoned"


def test_holding_the_blocks_failed_quarantines_them(side):
    d = started(side)
    d.send("request_finished")
    r = d.send("hold_failed", error="connector gone")
    assert r.state == "quarantined" and d.kinds("quarantine_blocks")


@pytest.mark.parametrize("rank", [-2, 64, 2**70])
def test_a_verdict_with_an_impossible_rank_is_ignored(side, rank):
    d = started(side, writers=1)
    r = d.send("write_done", producer_rank=rank)
    assert r.outcome is Outcome.IGNORED and d.state == "waiting"


@pytest.mark.parametrize("rank", ["0", None, True, 1.0])
def test_a_verdict_of_the_wrong_type_is_rejected_before_anything(side, rank):
    d = started(side, writers=1)
    r = d.send("write_done", producer_rank=rank)
    assert r.outcome is Outcome.REJECTED and d.state == "waiting"


@pytest.mark.parametrize("count", [0, -1, 65, "2", None, 1.5])
def test_a_bad_writer_count_creates_nothing(side, count):
    d = side("write_consumer")
    assert d.send("receive_started", num_writers=count).outcome is Outcome.REJECTED
    assert len(d.table) == 0


def test_a_second_remote_load_after_a_completed_one_never_waits(side):
    """vLLM may schedule the same transfer id again (a second remote load after a
    completed WRITE): the machine answers LATE at once, so the connector loads locally
    or with a fresh id instead of waiting forever as upstream does."""
    d = started(side)
    d.send("write_done", producer_rank=0)
    assert d.state == "received"
    again = d.send("receive_started", num_writers=1)
    assert again.outcome is Outcome.LATE and again.state == "received"
    assert d.send("blocks_allocated", block_ids=BLOCKS).outcome is Outcome.LATE


def test_a_writer_that_failed_before_the_allocation_fails_the_load_as_soon_as_blocks_come(side):
    """P's request ended before its transfer started, and P said so before D allocated: D
    does not wait for its write timeout, it releases P and fails the load at allocation."""
    d = side("write_consumer")
    d.send("receive_started", num_writers=1)
    r = d.send("write_failed", producer_rank=0, reason="aborted", writes_stopped=True)
    assert (r.outcome, r.state, r.effects) == (Outcome.APPLIED, "awaiting_allocation", ())
    assert d.send("write_failed", producer_rank=0, writes_stopped=True).outcome is Outcome.DUPLICATE
    r = d.send("blocks_allocated", block_ids=BLOCKS)
    assert r.state == "failed"
    assert d.kinds() == ["send_remote_blocks", "send_release", "report_load_failure"]
    assert not d.kinds("free_blocks")


def test_a_load_that_ended_before_it_started_releases_p_in_its_creating_step(side):
    d = side("write_consumer")
    r = d.send("finished_before_start")
    assert (r.outcome, r.state) == (Outcome.CREATED, "released")
    assert d.kinds() == ["send_release"]
    assert d.send("request_finished").outcome is Outcome.LATE
