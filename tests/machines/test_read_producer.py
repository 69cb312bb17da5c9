"""The READ producer (P) under every ordering and failure its spec promises to handle.

P's blocks go back exactly once: on the quorum of D ranks' releases or when the lease
(or the longest hold) runs out; never while the request runs, however early a release.
"""

from __future__ import annotations

import pytest

from moriio_fsm.runtime.events import Outcome


def leased(side, consumers: int = 1, **config):
    p = side("read_producer", **config)
    p.send("serve_started", consumer_tp_size=consumers)
    r = p.send("request_finished")
    assert r.state == "leased"
    [hold] = r.effects
    assert hold.kind == "hold_for_reads" and hold.lease_s == p.record.lease_s
    return p


def test_the_quorum_of_releases_frees_the_blocks_once(side):
    p = leased(side, consumers=2)
    assert p.send("release", consumer_tp_size=2, consumer_rank=1).state == "leased"
    assert p.send("release", consumer_tp_size=2, consumer_rank=1).outcome is Outcome.DUPLICATE
    r = p.send("release", consumer_tp_size=2, consumer_rank=0)
    assert r.state == "released"
    [freed] = p.kinds("free_blocks")
    assert freed.reason == "released"
    assert p.send("release", consumer_rank=0).outcome is Outcome.LATE


def test_heartbeats_renew_the_lease_and_are_answered(side):
    p = leased(side, lease_s=10.0)
    p.advance(8.0)
    r = p.send("heartbeat", consumer_rank=0, seq=3)
    [grant] = r.effects
    assert (grant.kind, grant.consumer_rank, grant.seq, grant.lease_s) == (
        "send_lease_granted",
        0,
        3,
        10.0,
    )
    p.advance(8.0)
    assert p.state == "leased"  # renewed at t~8: due at ~18
    p.advance(3.0)
    assert p.state == "expired"
    [freed] = p.kinds("free_blocks")
    assert freed.reason == "lease_expired"
    assert p.table.stats()["ended"] == {"expired": 1}


def test_a_lease_grant_never_promises_more_than_the_hold_has_left(side):
    p = leased(side, lease_s=10.0, max_hold_s=25.0)
    for _ in range(3):
        p.advance(7.0)
        r = p.send("heartbeat", seq=1)
    grant = r.effects[0]
    assert grant.lease_s == pytest.approx(25.0 - p.now + p.record.held_at, abs=1e-6)
    assert grant.lease_s < 10.0
    p.advance(grant.lease_s + 0.01)
    assert p.state == "expired"  # exactly when P said it would


def test_an_early_release_never_frees_the_blocks_of_a_running_request(side):
    p = side("read_producer")
    p.send("serve_started", consumer_tp_size=1)
    r = p.send("release", consumer_rank=0)
    assert r.state == "prefilling" and not p.kinds()
    r = p.send("request_finished")  # every D rank already released
    assert r.state == "released" and p.kinds() == []  # nothing held: vLLM frees them


def test_an_early_partial_release_still_holds_for_the_other_ranks(side):
    p = side("read_producer")
    p.send("serve_started", consumer_tp_size=2)
    p.send("release", consumer_rank=0)
    r = p.send("request_finished")
    assert r.state == "leased" and p.kinds() == ["hold_for_reads"]
    assert p.send("release", consumer_rank=1).state == "released"


def test_a_heartbeat_before_the_prefill_finished_is_ignored(side):
    p = side("read_producer")
    p.send("serve_started", consumer_tp_size=1)
    assert p.send("heartbeat", seq=1).outcome is Outcome.IGNORED
    assert not p.kinds()


def test_an_abort_before_the_prefill_holds_nothing(side):
    p = side("read_producer")
    p.send("serve_started", consumer_tp_size=1)
    assert p.send("abort").state == "aborted" and not p.kinds()


def test_a_release_for_a_transfer_p_does_not_know_is_counted(side):
    p = side("read_producer")
    assert p.send("release", consumer_rank=0).outcome is Outcome.BUFFERED
    p.advance(100.0)
    other = side("read_producer")
    other.table = p.table
    other.tid = "tx-2"
    other.send("serve_started", consumer_tp_size=1)  # creating tx-2 ages tx-1's fact...
    assert p.table.stats()["outcomes"]["buffered"] == 1  # ...which is held, never applied


def test_more_releases_than_consumers_are_ignored(side):
    p = leased(side, consumers=1)
    p.send("release")  # unranked: counted
    assert p.state == "released"


@pytest.mark.parametrize("count", [0, 65, "1", None])
def test_a_bad_consumer_count_creates_nothing(side, count):
    p = side("read_producer")
    assert p.send("serve_started", consumer_tp_size=count).outcome is Outcome.REJECTED


def test_a_hold_that_failed_ends_the_lease_at_once(side):
    p = leased(side)
    assert p.send("hold_failed", error="connector gone").state == "expired"
    assert not p.kinds("free_blocks")  # vLLM freed them itself
    assert p.send("heartbeat", seq=1).outcome is Outcome.LATE  # no grant: D will not read
