"""P's record of ended WRITE transfers: D's late release gets P's verdict again, and only for
transfers that ended here; the record stays bounded whatever a peer sends."""

from __future__ import annotations

from moriio_fsm.adapters.zmq import WriteFailed
from moriio_fsm.vllm.ended_verdicts import EndedVerdicts
from moriio_fsm.vllm.params import PeerAddress

D = PeerAddress(host="198.18.0.2", notify_port=7100, handshake_port=7200, tp_size=2)


def record(capacity: int = 8):
    sent: list = []
    return EndedVerdicts(lambda to, message: sent.append((to, message)), 1, capacity), sent


def test_a_release_for_an_ended_transfer_gets_writes_stopped_at_the_releasing_rank():
    verdicts, sent = record()
    verdicts.ended("tx-1", D, writes_stopped=True)
    assert verdicts.answer_release("tx-1", consumer_rank=1)
    [(to, message)] = sent
    assert to == ("198.18.0.2", 7101)  # D's rank 1 listens one port up
    assert message == WriteFailed("tx-1", reason="ended", writes_stopped=True, producer_rank=1)
    assert verdicts.answer_release("tx-1", consumer_rank=1)  # asked again: said again
    assert len(sent) == 2


def test_a_quarantined_transfer_never_claims_its_writes_stopped():
    verdicts, sent = record()
    verdicts.ended("tx-q", D, writes_stopped=False)
    verdicts.answer_release("tx-q", consumer_rank=-1)
    [(to, message)] = sent
    assert to == ("198.18.0.2", 7100) and message.writes_stopped is False


def test_unknown_ids_and_transfers_without_a_d_are_not_answered():
    verdicts, sent = record()
    verdicts.ended("tx-none", None, writes_stopped=True)
    assert not verdicts.answer_release("tx-none", 0)
    assert not verdicts.answer_release("never-here", 0)
    assert sent == [] and len(verdicts) == 0


def test_the_record_keeps_the_newest_ids_within_its_capacity():
    verdicts, sent = record(capacity=8)
    for i in range(10_000):
        verdicts.ended(f"tx-{i}", D, writes_stopped=True)
    assert len(verdicts) == 8
    assert not verdicts.answer_release("tx-0", 0)
    assert verdicts.answer_release("tx-9999", 0)
