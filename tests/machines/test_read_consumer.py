"""The READ consumer (D) under every ordering and failure its spec promises to handle.

The rule that matters most: D never reads a block after P may have freed it: reads are
posted only under a lease that covers them, renewed while they run, and torn down before
it can run out; and P is always told to release, even when a read failed.
"""

from __future__ import annotations

import pytest

from moriio_fsm.runtime.events import Outcome

REMOTE = [11, 12]


def ready(side, layers: int = 3, lease_s: float = 30.0, **config):
    d = side("read_consumer", **config)
    r = d.send("read_started", num_layers=layers, remote_block_ids=REMOTE)
    assert r.outcome is Outcome.CREATED
    assert [e.kind for e in r.effects] == ["request_handshake", "send_heartbeat"]
    assert r.effects[1].seq == 1
    d.send("handshake_done")
    r = d.send("lease_granted", seq=1, lease_s=lease_s)
    assert r.state == "ready"
    return d


def reading(side, layers: int = 3, **config):
    d = ready(side, layers, **config)
    r = d.send("start_reads")
    assert r.state == "reading"
    assert [(e.kind, e.layer) for e in r.effects] == [("post_read", i) for i in range(layers)]
    assert all(e.block_ids == REMOTE for e in r.effects)
    return d


def test_every_read_lands_then_p_is_released_and_the_load_reported(side):
    d = reading(side)
    for layer in range(3):
        r = d.send("layer_read_completed", layer=layer)
    assert r.state == "received"
    assert d.kinds()[-2:] == ["send_release", "report_received"]


def test_a_failed_read_still_releases_p_once_nothing_is_in_flight(side):
    d = reading(side)
    d.send("layer_read_failed", layer=1, code=13)
    assert d.state == "reading" and not d.kinds("send_release")
    d.send("layer_read_completed", layer=0)
    r = d.send("layer_read_completed", layer=2)
    assert r.state == "failed"
    assert d.kinds()[-2:] == ["send_release", "report_load_failure"]


def test_no_read_is_posted_under_a_lease_too_short_for_it(side):
    d = ready(side, lease_s=20.0, read_timeout_s=30.0)
    r = d.send("start_reads")
    assert r.state == "ready" and not d.kinds("post_read")
    d.advance(5.0)  # renewal tick: heartbeat 2
    [beat] = d.kinds("send_heartbeat")[1:]
    assert beat.seq == 2
    r = d.send("lease_granted", seq=2, lease_s=60.0)  # a longer lease arrives
    assert r.state == "reading" and len(d.kinds("post_read")) == 3


def test_a_grant_for_an_older_heartbeat_is_not_trusted(side):
    d = side("read_consumer")
    d.send("read_started", num_layers=1, remote_block_ids=REMOTE)
    d.send("handshake_done")
    r = d.send("lease_granted", seq=7, lease_s=30.0)
    assert r.outcome is Outcome.IGNORED and d.state == "setting_up"


def test_the_lease_is_renewed_while_reads_run(side):
    d = reading(side, renew_interval_s=5.0)
    d.advance(5.1)
    assert [e.seq for e in d.kinds("send_heartbeat")] == [1, 2]
    d.send("lease_granted", seq=2, lease_s=30.0)
    assert d.record.lease_until == pytest.approx(d.record.heartbeat_sent_at + 30.0)


def test_reads_are_torn_down_before_an_unrenewed_lease_can_run_out(side):
    d = reading(
        side, layers=6, lease_s=30.0, renew_interval_s=5.0, lease_margin_s=5.0, read_timeout_s=12.0
    )
    lease_until = d.record.lease_until
    layer = 0
    while d.state == "reading":  # P stopped answering heartbeats...
        d.advance(5.0)
        if d.state == "reading":
            d.send("layer_read_completed", layer=layer)  # ...while the reads still progress
            layer += 1
    assert d.state == "abandoning" and d.record.end_reason == "lease_at_risk"
    [abandon] = d.kinds("abandon_reads")
    assert abandon.layers == tuple(range(layer, 6))
    # Torn down early enough that a confirmed teardown ends before P may free its blocks.
    assert d.now + d.record.abandon_timeout_s < lease_until
    r = d.send("reads_abandoned")
    assert r.state == "failed"
    assert d.kinds()[-2:] == ["send_release", "report_load_failure"]


def test_a_teardown_nobody_confirms_quarantines_ds_blocks(side):
    d = reading(side, read_timeout_s=10.0, abandon_timeout_s=2.0)
    d.advance(10.5)  # no progress at all
    assert d.state == "abandoning"
    d.advance(2.5)
    assert d.state == "quarantined"
    assert d.kinds()[-2:] == ["quarantine_blocks", "report_load_failure"]
    assert not d.kinds("send_release") and d.table.stats()["anomalies"] == 1


def test_a_failed_handshake_releases_p_and_fails_the_load(side):
    d = side("read_consumer")
    d.send("read_started", num_layers=2, remote_block_ids=REMOTE)
    r = d.send("handshake_failed", error="refused")
    assert r.state == "failed" and d.kinds()[-2:] == ["send_release", "report_load_failure"]


def test_setup_that_never_finishes_times_out(side):
    d = side("read_consumer", setup_timeout_s=3.0)
    d.send("read_started", num_layers=2, remote_block_ids=REMOTE)
    d.send("handshake_done")
    d.advance(3.5)
    assert d.state == "failed"


def test_the_request_ending_mid_read_holds_ds_blocks_until_the_reads_settle(side):
    d = reading(side)
    r = d.send("request_finished")
    assert r.state == "reading" and [e.kind for e in r.effects] == ["hold_blocks"]
    for layer in range(3):
        d.send("layer_read_completed", layer=layer)
    assert d.state == "released"
    assert d.kinds()[-2:] == ["send_release", "free_blocks"]
    assert not d.kinds("report_received")


def test_the_request_ending_before_any_read_releases_p_and_frees_at_once(side):
    # vLLM keeps the blocks of a request that waited for its load until D says so.
    d = ready(side)
    r = d.send("request_finished")
    assert r.state == "released" and d.kinds()[-2:] == ["send_release", "free_blocks"]


def test_a_post_that_raised_counts_as_a_failed_read(side):
    d = reading(side, layers=1)
    r = d.send("post_failed", layer=0, error="engine refused")
    assert r.state == "failed"


@pytest.mark.parametrize("lease", [float("nan"), float("inf"), -1.0])
def test_an_impossible_lease_is_not_trusted(side, lease):
    d = side("read_consumer")
    d.send("read_started", num_layers=1, remote_block_ids=REMOTE)
    r = d.send("lease_granted", seq=1, lease_s=lease)
    assert r.outcome is Outcome.IGNORED and d.record.lease_until == 0.0
