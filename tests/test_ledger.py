"""The block ledger the joint simulation, the chaos run and the model checker share: each
misuse of a transfer's blocks is found once, under the same rule name, whoever asks."""

from __future__ import annotations

from types import SimpleNamespace

from moriio_fsm import ledger as rules
from moriio_fsm.ledger import (
    FREED_UNDER_OPERATION,
    GONE,
    HELD,
    LEAVE_ONCE,
    OPERATION_ON_FREED,
    QUARANTINED,
    Ledger,
)


def pair(ledger: Ledger, tid: str = "tx-1"):
    return ledger.blocks("P0", tid), ledger.blocks("D0", tid)


def test_the_ledger_counts_each_misuse_once():
    ledger = Ledger()
    p, d = pair(ledger)
    write = ledger.post("write of layer 0", p, d)
    ledger.hand_back(d, "report_received")  # D used blocks P still writes into
    assert ledger.counts == {FREED_UNDER_OPERATION: 1}
    ledger.hand_back(d, "free_blocks")
    assert ledger.counts == {FREED_UNDER_OPERATION: 1, LEAVE_ONCE: 1}
    ledger.settle(write)
    ledger.post("write of layer 1", p, d)  # into blocks that went back
    assert ledger.counts[OPERATION_ON_FREED] == 1
    assert [str(v) for v in ledger.violations] == [
        "freed_under_operation: D0/tx-1: report_received while write of layer 0 may still "
        "be in flight",
        "blocks_leave_once: D0/tx-1: free_blocks after the blocks had already left "
        "(report_received)",
        "operation_on_freed_blocks: D0/tx-1: write of layer 1 posted after the blocks went "
        "back (report_received)",
    ]


def test_a_read_into_quarantined_blocks_may_outlive_the_source():
    ledger = Ledger()
    p, d = pair(ledger)
    ledger.post("read of layer 0", p, d)
    ledger.quarantine(d)
    ledger.hand_back(p, "free_blocks")  # the lease ran out: harmless now
    ledger.hand_back(d, "report_load_failure")  # frees nothing: they stay out
    assert ledger.violations == []
    assert (p.custody, d.custody) == (GONE, QUARANTINED)


def test_blocks_still_written_into_may_not_go_back_even_if_quarantined_elsewhere():
    ledger = Ledger()
    p, d = pair(ledger)
    ledger.post("read of layer 0", p, d)
    ledger.quarantine(p)
    ledger.hand_back(d, "free_blocks")  # the read still lands in them
    assert ledger.counts == {FREED_UNDER_OPERATION: 1}


def test_quarantined_blocks_leave_by_no_other_way():
    ledger = Ledger()
    _, d = pair(ledger)
    ledger.quarantine(d)
    ledger.hand_back(d, "free_blocks")
    ledger.hand_back(d, "report_received")
    ledger.quarantine(d)
    assert ledger.counts == {LEAVE_ONCE: 3}
    assert ledger.violations[0].message == "D0/tx-1: free_blocks after the blocks were quarantined"


def test_blocks_quarantined_after_they_went_back_are_caught():
    ledger = Ledger()
    p, _ = pair(ledger)
    ledger.hand_back(p, "free_blocks")
    ledger.quarantine(p)
    assert [str(v) for v in ledger.violations] == [
        "blocks_leave_once: P0/tx-1: quarantine_blocks after the blocks had already left "
        "(free_blocks)"
    ]


def test_bytes_moved_after_the_blocks_went_back_are_caught():
    ledger = Ledger()
    p, d = pair(ledger)
    write = ledger.post("write of layer 2", p, d)
    ledger.hand_back(p, "free_blocks")
    ledger.moved(write)
    assert ledger.counts == {FREED_UNDER_OPERATION: 1, OPERATION_ON_FREED: 1}
    assert (
        "P0/tx-1: write of layer 2 moved bytes after the blocks went back (free_blocks)"
        == ledger.violations[1].message
    )


def test_a_settled_operation_no_longer_holds_the_blocks():
    ledger = Ledger()
    p, d = pair(ledger)
    ledger.settle(ledger.post("write of layer 0", p, d))
    ledger.hand_back(p, "free_blocks")
    ledger.hand_back(d, "report_received")
    assert ledger.violations == []


def test_a_dead_rank_is_no_longer_judged():
    ledger = Ledger()
    p, d = pair(ledger)
    ledger.post("write of layer 0", p, d)
    ledger.bury("D0")
    ledger.hand_back(d, "free_blocks")
    ledger.hand_back(d, "free_blocks")
    assert ledger.violations == []
    ledger.hand_back(p, "free_blocks")  # P's blocks are still judged
    assert ledger.counts == {FREED_UNDER_OPERATION: 1}


def test_only_the_first_breaches_are_kept_but_all_are_counted():
    ledger = Ledger(keep=2)
    for index in range(5):
        p, _ = pair(ledger, f"tx-{index}")
        ledger.hand_back(p, "free_blocks")
        ledger.hand_back(p, "free_blocks")
    assert ledger.counts == {LEAVE_ONCE: 5} and len(ledger.violations) == 2


def test_handlers_carry_out_exactly_the_effects_that_move_blocks():
    ledger = Ledger()
    handlers = ledger.handlers("D0", ("send_release", "report_received", "quarantine_blocks"))
    assert set(handlers) == {"report_received", "quarantine_blocks"}
    effect = SimpleNamespace(transfer_id="tx-9")
    handlers["quarantine_blocks"](effect)
    handlers["report_received"](effect)
    assert ledger.blocks("D0", "tx-9").custody == QUARANTINED
    assert [v.rule for v in ledger.violations] == [LEAVE_ONCE]


def test_the_judges_take_custody_as_the_model_checker_keeps_it():
    assert rules.hand_back(HELD, "free_blocks") == (GONE, None)
    assert rules.hand_back(HELD, "free_blocks", "a write into them (layer(s) 0)", owner="D") == (
        GONE,
        rules.Violation(
            FREED_UNDER_OPERATION,
            "D: free_blocks while a write into them (layer(s) 0) may still be in flight",
        ),
    )
    assert rules.hand_back(QUARANTINED, "report_load_failure") == (QUARANTINED, None)
    assert (
        rules.quarantine(QUARANTINED)[1].message
        == "quarantine_blocks after the blocks were quarantined"
    )
    assert rules.posted(QUARANTINED, "a read of layer 0") is None
    assert (
        rules.posted(GONE, "a read of layer 0", owner="P").message
        == "P: a read of layer 0 posted after the blocks went back"
    )
    assert not rules.reaches(False, QUARANTINED) and rules.reaches(True, QUARANTINED)
    assert rules.never_left("released").rule == LEAVE_ONCE
