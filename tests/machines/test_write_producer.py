"""The WRITE producer machine under every ordering the spec promises to handle.

Every table here checks all spec invariants after every step, so each test also
proves the invariants hold along its path.
"""

from __future__ import annotations

import pytest

from moriio_fsm.machines import build_table
from moriio_fsm.runtime.declared import make_event
from moriio_fsm.runtime.events import Outcome

BLOCKS = {"block_ids": [4, 5, 6], "decode_rank": 1}
LAYERS = 8


class Producer:
    """Drives one transfer and keeps every effect it produced, in order."""

    def __init__(self, tid: str = "tx-1", **config):
        self.table = build_table("write_producer", check_invariants=True, config=config or None)
        self.tid = tid
        self.now = 0.0
        self.effects: list = []
        self.results: list = []

    def send(self, kind: str, **data):
        self.now += 0.001
        result = self.table.dispatch(make_event(kind, self.tid, self.now, data))
        self.effects.extend(result.effects)
        self.results.append(result)
        return result

    def advance(self, seconds: float):
        self.now += seconds
        fired = self.table.advance(self.now)
        for _, result in fired:
            self.effects.extend(result.effects)
        return fired

    def create(self, num_writers: int = 1):
        return self.send("prefill_started", num_writers=num_writers)

    def schedule(self, layers):
        return [self.send("layer_scheduled", layer=layer) for layer in layers]

    def complete(self, layers):
        return [self.send("layer_write_completed", layer=layer) for layer in layers]

    def kinds(self, kind: str) -> list:
        return [e for e in self.effects if e.kind == kind]

    def posted_layers(self) -> list[int]:
        return sorted(e.layer for e in self.kinds("post_write"))

    @property
    def state(self):
        return self.table.state_of(self.tid)


def test_allocation_before_scheduling_runs_the_clean_path():
    p = Producer()
    p.create(num_writers=2)
    p.send("remote_blocks", **BLOCKS)
    p.schedule(range(LAYERS))
    assert p.posted_layers() == list(range(LAYERS))
    p.send("seal")
    assert p.state == "sealed"
    p.complete(range(LAYERS - 1))
    assert p.state == "sealed" and not p.kinds("send_write_done")
    last = p.complete([LAYERS - 1])[0]
    assert last.state == "completed"
    [done] = p.kinds("send_write_done")
    assert done.data["num_writers"] == 2 and done.data["decode_rank"] == 1
    assert not p.kinds("free_blocks")  # vLLM has not finished the request yet
    p.send("request_finished")
    assert p.state == "released"
    assert len(p.kinds("free_blocks")) == 1 and not p.kinds("send_write_failed")


def test_allocation_during_scheduling_posts_waiting_layers_at_once():
    p = Producer()
    p.create()
    p.schedule([0, 1, 2])
    assert not p.kinds("post_write")
    r = p.send("remote_blocks", **BLOCKS)
    assert [(e.kind, e.layer) for e in r.effects] == [
        ("post_write", 0),
        ("post_write", 1),
        ("post_write", 2),
    ]
    assert all(e.block_ids == BLOCKS["block_ids"] and e.decode_rank == 1 for e in r.effects)
    p.schedule([3])
    assert p.posted_layers() == [0, 1, 2, 3]


def test_allocation_after_seal_and_request_finish_still_completes():
    p = Producer()
    p.create()
    p.schedule(range(LAYERS))
    p.send("seal")
    p.send("request_finished")
    assert p.state == "sealed" and not p.kinds("post_write")
    p.send("remote_blocks", **BLOCKS)
    assert p.posted_layers() == list(range(LAYERS))
    p.complete(range(LAYERS))
    assert p.state == "released"
    assert len(p.kinds("send_write_done")) == 1 and len(p.kinds("free_blocks")) == 1


def test_duplicate_allocation_is_idempotent_and_keeps_progress():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1])
    p.complete([0])
    record = p.table.get(p.tid)
    before = (record.posted, record.settled, record.failed, record.remote_block_ids)
    again = p.send("remote_blocks", block_ids=[90, 91, 92], decode_rank=3)
    assert again.outcome is Outcome.DUPLICATE and again.effects == ()
    record = p.table.get(p.tid)
    assert (record.posted, record.settled, record.failed, record.remote_block_ids) == before
    assert record.decode_rank == 1


def test_layers_are_deduplicated_and_seal_counts_what_was_scheduled():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    first = p.send("layer_scheduled", layer=3)
    again = p.send("layer_scheduled", layer=3)
    assert first.outcome is Outcome.APPLIED and again.outcome is Outcome.DUPLICATE
    assert again.effects == ()
    p.schedule([5, 3, 7])
    p.send("seal")
    # The model registered 64 cache tensors but only three layers' hooks fired.
    assert p.table.get(p.tid).writes_expected == 3
    p.complete([3, 5, 7])
    assert p.state == "completed"


def test_completion_is_counted_when_it_happens_not_when_posted():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule(range(4))
    p.send("seal")
    assert p.table.get(p.tid).posted == 0b1111
    assert p.state == "sealed" and not p.kinds("send_write_done")
    dup = p.complete([0, 0])
    assert [r.outcome for r in dup] == [Outcome.APPLIED, Outcome.DUPLICATE]
    assert p.table.get(p.tid).settled == 0b1


def test_completions_before_seal_finish_on_seal():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule(range(3))
    p.complete(range(3))
    assert p.state == "scheduling"
    r = p.send("seal")
    assert r.state == "completed"
    assert r.hops == (("scheduling", "sealed"), ("sealed", "completed"))
    assert [e.kind for e in r.effects] == ["send_write_done"]


def test_completion_for_a_layer_never_posted_is_rejected_not_counted():
    p = Producer()
    p.create()
    p.schedule([0])  # scheduled, but no allocation, so never posted
    r = p.send("layer_write_completed", layer=0)
    assert r.outcome is Outcome.REJECTED
    assert p.table.get(p.tid).settled == 0


def test_seal_with_no_layer_scheduled_sends_nothing():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    r = p.send("seal")
    assert r.outcome is Outcome.IGNORED and r.state == "allocated"
    assert not p.kinds("send_write_done")
    p.schedule([0])
    p.send("seal")
    p.complete([0])
    assert len(p.kinds("send_write_done")) == 1


def test_failed_write_tells_d_only_once_no_write_can_still_land():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule(range(4))
    p.send("seal")
    p.send("request_finished")
    r = p.send("layer_write_failed", layer=1, code=13)
    assert r.state == "draining"
    # Layers 0, 2 and 3 may still be writing into D's blocks: D must not free them yet.
    assert not p.kinds("send_write_failed")
    p.complete([0, 2])
    assert p.state == "draining" and not p.kinds("send_write_failed")
    r = p.send("layer_write_failed", layer=3, code=13)
    assert r.hops == (("draining", "closing"), ("closing", "failed"))
    assert [e.kind for e in r.effects] == ["send_write_failed", "free_blocks"]
    assert r.effects[0].data["reason"] == "failed"
    assert not p.kinds("send_write_done")


def test_d_hears_of_a_failure_before_the_local_request_finishes():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0])
    p.send("seal")
    r = p.send("layer_write_failed", layer=0, code=13)
    assert r.state == "closing"
    assert [e.kind for e in r.effects] == ["send_write_failed"]
    assert not p.kinds("free_blocks")  # vLLM still owns the blocks
    p.send("request_finished")
    assert p.state == "failed" and len(p.kinds("free_blocks")) == 1


@pytest.mark.parametrize("stage", ["allocated", "scheduling", "sealed"])
def test_release_from_d_ends_released_and_d_hears_once_no_write_can_land(stage):
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    if stage != "allocated":
        p.schedule([0, 1])
    if stage == "sealed":
        p.send("seal")
    if stage != "allocated":
        p.send("request_finished")
    r = p.send("release")
    in_flight = stage != "allocated"
    assert r.state == ("draining" if in_flight else "closing")
    if in_flight:
        p.complete([0, 1])
    else:
        p.send("request_finished")
    assert p.state == "released"
    assert len(p.kinds("free_blocks")) == 1
    # D released its request but keeps its blocks until P says its writes stopped.
    [stopped] = p.kinds("send_write_failed")
    assert stopped.reason == "released" and stopped.writes_stopped is True
    assert not p.kinds("send_write_done")


def test_a_release_after_completion_gets_write_done_again():
    """D released: its write_done was lost (or crossed the release); P says it again, every
    time D asks, and counts it once."""
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0])
    p.send("seal")
    p.complete([0])
    for _ in range(2):
        r = p.send("release")
        assert r.outcome is Outcome.APPLIED and r.state == "completed"
        assert [e.kind for e in r.effects] == ["send_write_done"]
    assert len(p.kinds("send_write_done")) == 3
    assert p.table.get(p.tid).write_done_sent == 1


def test_a_release_after_p_told_d_its_writes_stopped_gets_that_again():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0])
    p.send("layer_write_failed", layer=0, code=13)
    assert p.state == "closing"
    [first] = p.kinds("send_write_failed")
    r = p.send("release")
    assert r.state == "closing" and [e.kind for e in r.effects] == ["send_write_failed"]
    again = r.effects[0]
    assert again.writes_stopped is True and again.reason == first.reason
    assert p.table.get(p.tid).write_failed_sent == 1


def test_a_release_while_writes_drain_waits_for_them():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1])
    p.send("layer_write_failed", layer=0, code=13)  # layer 1 is still in flight
    assert p.state == "draining"
    r = p.send("release")
    assert r.outcome is Outcome.IGNORED and not r.effects


@pytest.mark.parametrize("stage", ["allocated", "scheduling", "sealed", "completed", "draining"])
def test_abort_at_any_time_hands_blocks_back_exactly_once(stage):
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    if stage in ("scheduling", "sealed", "completed", "draining"):
        p.schedule([0, 1])
    if stage in ("sealed", "completed", "draining"):
        p.send("seal")
    if stage == "completed":
        p.complete([0, 1])
    if stage == "draining":
        p.send("layer_write_failed", layer=0, code=13)
    assert p.state == stage
    p.send("abort")
    if p.state == "draining":
        assert not p.kinds("free_blocks")  # writes still in flight: blocks stay
        p.complete([0, 1])
    assert p.state in {"aborted", "released", "failed"}
    assert len(p.kinds("free_blocks")) == 1
    # D hears exactly one verdict: either write_done or write_failed.
    assert len(p.kinds("send_write_done")) + len(p.kinds("send_write_failed")) == 1
    if stage == "completed":
        assert p.state == "released"
    elif stage == "draining":
        assert p.state == "failed"
    else:
        assert p.state == "aborted"


def test_request_finished_twice_is_a_duplicate():
    p = Producer()
    p.create()
    p.schedule([0])
    assert p.send("request_finished").outcome is Outcome.APPLIED
    assert p.send("request_finished").outcome is Outcome.DUPLICATE


def test_a_request_that_finished_without_any_layer_fails_the_transfer():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    r = p.send("request_finished")
    assert r.state == "failed"
    assert [e.kind for e in r.effects] == ["send_write_failed", "free_blocks"]
    assert r.effects[0].data == {"reason": "failed", "decode_rank": 1, "writes_stopped": True}


@pytest.mark.parametrize(
    "kind, end, reason",
    [("finished_before_start", "failed", "failed"), ("aborted_before_start", "aborted", "aborted")],
)
def test_a_request_that_ended_before_its_transfer_started_ends_it_in_the_creating_step(
    kind, end, reason
):
    """The transfer starts only to end: D hears write_failed (its writes never started) and
    the blocks go back, in the step that creates it; the request's end repeated is late."""
    p = Producer()
    r = p.send(kind)
    assert (r.outcome, r.state) == (Outcome.CREATED, end)
    assert [e.kind for e in r.effects] == ["send_write_failed", "free_blocks"]
    assert r.effects[0].data == {"reason": reason, "decode_rank": -1, "writes_stopped": True}
    assert p.send("request_finished").outcome is Outcome.LATE


def test_defer_timeout_expires_a_transfer_whose_allocation_never_came():
    p = Producer(defer_timeout_s=5.0)
    p.create()
    p.schedule([0, 1])
    p.send("seal")
    p.send("request_finished")
    assert p.advance(4.0) == []
    fired = p.advance(2.0)
    kinds = [ev.kind for ev, _ in fired]
    assert "defer_timeout" in kinds
    assert p.state == "expired"
    [failed] = p.kinds("send_write_failed")
    assert failed.data["reason"] == "expired"
    assert len(p.kinds("free_blocks")) == 1


def test_defer_timeout_is_ignored_once_the_allocation_arrived():
    p = Producer(defer_timeout_s=5.0, transfer_timeout_s=100.0)
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0])
    fired = p.advance(6.0)
    assert [(ev.kind, r.outcome) for ev, r in fired] == [("defer_timeout", Outcome.IGNORED)]
    assert p.state == "scheduling"


def test_transfer_timeout_tears_stalled_writes_down_and_frees_only_after_teardown():
    p = Producer(transfer_timeout_s=3.0)
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1, 2])
    p.send("seal")
    p.complete([0])
    p.send("request_finished")
    p.advance(3.5)  # layers 1 and 2 never report back
    assert p.state == "abandoning"
    [abandon] = p.kinds("abandon_writes")
    assert abandon.layers == (1, 2)
    assert not p.kinds("send_write_failed") and not p.kinds("free_blocks")
    r = p.send("writes_abandoned")  # the adapter tore the writes down
    assert [e.kind for e in r.effects] == ["send_write_failed", "free_blocks"]
    assert r.effects[0].writes_stopped is True
    assert p.state == "failed"
    assert p.send("layer_write_completed", layer=1).outcome is Outcome.LATE


def test_a_teardown_nobody_confirms_ends_quarantined_and_keeps_the_blocks():
    p = Producer(transfer_timeout_s=3.0, abandon_timeout_s=2.0)
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1])
    p.send("seal")
    p.send("request_finished")
    p.advance(3.5)
    assert p.state == "abandoning"
    p.advance(1.0)
    assert p.state == "abandoning"  # the adapter still has time to answer
    p.advance(1.5)
    assert p.state == "quarantined"
    [told] = p.kinds("send_write_failed")
    assert told.writes_stopped is False  # D must keep its blocks out of use too
    assert [e.kind for e in p.kinds("quarantine_blocks")] == ["quarantine_blocks"]
    assert not p.kinds("free_blocks")  # the blocks never go back
    stats = p.table.stats()
    assert stats["anomalies"] == 1 and stats["ended"] == {"quarantined": 1}
    assert p.send("writes_abandoned").outcome is Outcome.LATE


def test_a_failed_teardown_quarantines_at_once():
    p = Producer(transfer_timeout_s=3.0)
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0])
    p.send("seal")
    p.advance(3.5)
    r = p.send("abandon_failed", error="session gone")
    assert r.state == "quarantined"
    assert [e.kind for e in r.effects] == ["send_write_failed", "quarantine_blocks"]


def test_writes_that_land_while_being_torn_down_end_the_transfer_normally():
    p = Producer(transfer_timeout_s=3.0)
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1])
    p.send("seal")
    p.send("request_finished")
    p.advance(3.5)
    assert p.state == "abandoning"
    p.complete([0])
    r = p.send("layer_write_failed", layer=1, code=13)
    assert r.state == "failed"
    assert [e.kind for e in r.effects] == ["send_write_failed", "free_blocks"]


def test_a_post_whose_handler_failed_settles_its_layer_as_failed():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1])
    r = p.send("post_failed", layer=1, error="engine refused")
    assert r.state == "draining"  # layer 0 may still be writing
    assert p.table.get(p.tid).failed == 0b10
    r = p.send("layer_write_completed", layer=0)
    assert r.state == "closing"
    assert [e.kind for e in r.effects] == ["send_write_failed"]


def test_a_message_to_d_that_could_not_be_sent_is_counted_and_the_transfer_goes_on():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0])
    p.send("seal")
    p.complete([0])
    assert p.state == "completed"
    r = p.send("notify_failed", error="outbox full")
    assert r.outcome is Outcome.APPLIED and p.table.get(p.tid).notify_failures == 1
    p.send("request_finished")
    assert p.state == "released"


def test_allocation_after_an_ignored_transfer_timeout_rearms_the_deadline():
    p = Producer(transfer_timeout_s=3.0, defer_timeout_s=50.0)
    p.create()
    p.schedule([0])
    p.send("seal")
    fired = p.advance(4.0)  # no allocation yet: the defer timer governs
    assert [(ev.kind, r.outcome) for ev, r in fired] == [("transfer_timeout", Outcome.IGNORED)]
    p.send("remote_blocks", **BLOCKS)  # layer 0 is posted now...
    p.send("request_finished")
    p.advance(4.0)  # ...and stalls: the re-armed deadline fires
    assert p.state == "abandoning"
    assert p.kinds("abandon_writes")


def test_a_stall_before_seal_still_times_out():
    p = Producer(transfer_timeout_s=3.0)
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1])
    p.advance(4.0)  # seal never came and nothing completed
    assert p.state == "abandoning"
    assert p.table.get(p.tid).end_reason == "failed"


def test_progress_pushes_the_transfer_deadline_back():
    p = Producer(transfer_timeout_s=3.0)
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.schedule([0, 1, 2])
    p.send("seal")
    p.advance(2.0)
    p.complete([0])  # progress at t~2: deadline moves to ~5
    p.advance(2.0)  # t~4: the first deadline passed, stale
    assert p.state == "sealed"
    p.complete([1])
    p.advance(2.0)
    assert p.state == "sealed"
    p.advance(2.0)
    assert p.state == "abandoning"


@pytest.mark.parametrize(
    "bad",
    [
        {"layer": -1},
        {"layer": 4096},
        {"layer": "3"},
        {"layer": None},
        {"layer": 2.0},
        {"layer": True},
        {"layer": 2**80},
    ],
)
def test_bad_layer_payloads_are_rejected_not_crashes(bad):
    p = Producer()
    p.create()
    r = p.send("layer_scheduled", **bad)
    assert r.outcome is Outcome.REJECTED
    assert p.table.get(p.tid).scheduled == 0


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5])
def test_create_refuses_a_bad_writer_count(bad):
    p = Producer()
    r = p.create(num_writers=bad)
    assert r.outcome is Outcome.REJECTED and r.state is None
    assert p.state is None and len(p.table) == 0
    assert p.table.next_deadline() is None  # nothing was armed for it


def test_an_event_missing_a_declared_payload_field_cannot_be_built():
    with pytest.raises(TypeError, match="layer"):
        make_event("layer_scheduled", "tx-1", 0.0, {})
    with pytest.raises(TypeError, match="colour"):
        make_event("layer_scheduled", "tx-1", 0.0, {"layer": 1, "colour": "red"})


@pytest.mark.parametrize(
    "bad",
    [
        {"block_ids": None, "decode_rank": 0},
        {"block_ids": [1], "decode_rank": "0"},
        {"block_ids": "1,2", "decode_rank": 0},
        {"block_ids": [1], "decode_rank": True},
    ],
)
def test_malformed_peer_messages_are_rejected_before_and_after_creation(bad):
    p = Producer()
    assert p.send("remote_blocks", **bad).outcome is Outcome.REJECTED
    assert p.table.stats()["pending_events"] == 0
    p.create()
    assert p.send("remote_blocks", **bad).outcome is Outcome.REJECTED
    assert not p.table.get(p.tid).has_allocation


def test_events_after_the_end_are_late_and_never_revive_the_transfer():
    p = Producer()
    p.create()
    p.send("release")
    p.send("request_finished")
    assert p.state == "released"
    for kind, data in (
        ("remote_blocks", BLOCKS),
        ("layer_write_completed", {"layer": 0}),
        ("prefill_started", {"num_writers": 1}),
        ("release", {}),
        ("abort", {}),
    ):
        assert p.send(kind, **data).outcome is Outcome.LATE
    assert len(p.table) == 0
    assert len(p.kinds("free_blocks")) == 1


# -- a forward's layers in one step (layers_scheduled, a bitmap) -----------------------------


def test_a_forwards_layers_in_one_step_post_each_once_and_complete_as_layer_by_layer_would():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    r = p.send("layers_scheduled", layers=(1 << LAYERS) - 1)
    assert r.outcome is Outcome.APPLIED and r.state == "scheduling"
    assert [e.layer for e in r.effects] == list(range(LAYERS))
    assert all(e.kind == "post_write" and e.block_ids == BLOCKS["block_ids"] for e in r.effects)
    again = p.send("layers_scheduled", layers=(1 << LAYERS) - 1)
    assert again.outcome is Outcome.DUPLICATE and again.effects == ()
    p.send("seal")
    assert p.table.get(p.tid).writes_expected == LAYERS
    p.complete(range(LAYERS))
    p.send("request_finished")
    assert p.state == "released" and len(p.kinds("send_write_done")) == 1
    assert p.posted_layers() == list(range(LAYERS))


def test_layers_scheduled_before_the_allocation_wait_for_it_and_mix_with_single_layers():
    p = Producer()
    p.create()
    p.schedule([1])  # one layer during the forward
    r = p.send("layers_scheduled", layers=0b1011)  # the rest at its end, layer 1 again
    assert r.outcome is Outcome.APPLIED and r.effects == ()
    assert p.table.get(p.tid).scheduled == 0b1011
    posted = p.send("remote_blocks", **BLOCKS)
    assert sorted(e.layer for e in posted.effects) == [0, 1, 3]
    late = p.send("layers_scheduled", layers=0b1111)  # only layer 2 is new: only it is posted
    assert [e.layer for e in late.effects] == [2]
    p.send("seal")
    p.complete([0, 1, 2, 3])
    assert p.state == "completed" and p.posted_layers() == [0, 1, 2, 3]


def test_layers_scheduled_after_seal_or_the_end_changes_nothing():
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    p.send("layers_scheduled", layers=0b11)
    p.send("seal")
    assert p.send("layers_scheduled", layers=0b11).outcome is Outcome.DUPLICATE
    # A new layer after the seal would change what D waits for: no row takes it.
    assert p.send("layers_scheduled", layers=0b111).outcome is Outcome.REJECTED
    assert p.table.get(p.tid).scheduled == 0b11 and p.posted_layers() == [0, 1]
    p.send("abort")
    p.complete([0, 1])
    assert p.state == "aborted"
    assert p.send("layers_scheduled", layers=0b100).outcome is Outcome.LATE
    assert p.posted_layers() == [0, 1]


@pytest.mark.parametrize(
    "bad", [0, -1, -(1 << 70), 1 << 4096, (1 << 4096) | 1, "3", None, 2.0, True, [1, 2]]
)
def test_bad_layer_sets_are_rejected_not_crashes(bad):
    p = Producer()
    p.create()
    p.send("remote_blocks", **BLOCKS)
    r = p.send("layers_scheduled", layers=bad)
    assert r.outcome is Outcome.REJECTED and r.effects == ()
    assert p.table.get(p.tid).scheduled == 0 and p.state == "allocated"
