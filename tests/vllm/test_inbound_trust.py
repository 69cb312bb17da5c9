"""Verdicts about a transfer count only when its own peer sends them.

P and D are vLLM's real schedulers with the connector, listening on 127.0.0.1; a forger on
127.0.0.2 (another address of this host, which no request names) learns the transfer id,
as a client can, and sends the messages that would end or corrupt the transfer. Nothing it
sends may change the transfer; the real peer's messages still complete it, token for token.
"""

from __future__ import annotations

import time

import pytest
import zmq
from harness import capture_wire, run_until, write_pair_params

from moriio_fsm.adapters.zmq import (
    Heartbeat,
    LeaseGranted,
    Release,
    RemoteBlocks,
    WriteDone,
    WriteFailed,
    encode_notify,
)

pytestmark = pytest.mark.integration

PROMPT = list(range(10, 50))
TOKENS = 5
FORGER = "127.0.0.2"


class Forger:
    """A DEALER connecting from 127.0.0.2 to one listener."""

    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{FORGER}:0;127.0.0.1:{port}")

    def send(self, message) -> None:
        self.sock.send(encode_notify(message))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def reference(make_instance):
    single = make_instance("single", "kv_consumer")
    single.add("ref", PROMPT, TOKENS, None)
    assert run_until([single], lambda: len(single.outputs.get("ref", [])) >= TOKENS)
    return single.outputs["ref"]


def forged_count(instance, side):
    return instance.worker._worker.drivers[side].table.stats()["outcomes"]["forged"]


def wait_for(condition, steps=(), timeout_s=5.0) -> bool:
    return run_until(list(steps), condition, timeout_s)


def test_forged_verdicts_to_a_waiting_d_change_nothing_and_the_real_p_still_completes(
    make_instance,
):
    expected = reference(make_instance)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    to_p, to_d = write_pair_params("tx-forge", P, D)
    D.add("d-1", PROMPT, TOKENS, to_d)
    for _ in range(3):
        D.step()  # D allocated and waits for P
    forger = Forger(D.notify_port)
    try:
        forger.send(WriteDone("tx-forge", 1))
        forger.send(WriteFailed("tx-forge", reason="forged", writes_stopped=False))
        assert wait_for(lambda: forged_count(D, "receive") == 2, [D])
        for _ in range(5):
            D.step()
        assert D.reported_recving == [] and D.load_errors == set()
        assert "d-1" in D.scheduler.requests and D.outputs.get("d-1", []) == []
    finally:
        forger.close()
    P.add("p-1", PROMPT, 1, to_p)  # the real P now writes and says so
    assert run_until(
        [P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and P.empty() and D.empty()
    )
    assert D.outputs["d-1"] == expected
    assert D.reported_recving == ["d-1"]
    assert D.worker._worker.metrics.snapshot()["events"].get("forged") == 2


def test_forged_allocation_and_release_sent_to_p_before_and_after_it_starts_change_nothing(
    make_instance,
):
    expected = reference(make_instance)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    p_wire = capture_wire(P)
    to_p, to_d = write_pair_params("tx-forge-p", P, D)
    forger = Forger(P.notify_port)
    try:
        # Held by P before its transfer exists, then refused when it is created.
        forger.send(RemoteBlocks("tx-forge-p", "forged", (1, 2, 3), 0))
        time.sleep(0.2)
        P.add("p-1", PROMPT, 1, to_p)
        for _ in range(3):
            P.step()
        forger.send(Release("tx-forge-p", consumer_tp_size=1))
        assert wait_for(lambda: forged_count(P, "send") == 2, [P])
        assert not [m for _, m in p_wire if type(m) in (WriteDone, WriteFailed)]
    finally:
        forger.close()
    D.add("d-1", PROMPT, TOKENS, to_d)
    assert run_until(
        [P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and P.empty() and D.empty()
    )
    assert D.outputs["d-1"] == expected
    assert [type(m) for _, m in p_wire] == [WriteDone]


def test_read_mode_p_keeps_its_blocks_for_the_d_reading_them_despite_a_forged_release(
    make_instance,
):
    expected = reference(make_instance)
    P = make_instance("P", "kv_producer", True)
    D = make_instance(
        "D",
        "kv_consumer",
        True,
        extra={"machine_config": {"read_consumer": {"read_timeout_s": 1.0}}},
    )
    D.scheduler.recompute_kv_load_failures = True
    p_wire = capture_wire(P)
    P.add("p-1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "tx-forge-r"})
    assert run_until([P], lambda: "p-1" in P.params_out)
    D.worker._worker.engine.faults.stall_nth(1)  # D's first read hangs a while: P must hold
    D.add("d-1", PROMPT, TOKENS, P.params_out["p-1"])
    # D spoke first (its heartbeat) and reads under the lease P granted it.
    assert run_until([P, D], lambda: any(type(m) is LeaseGranted for _, m in p_wire))
    grants_to = dict(P.worker._worker.directory.get("tx-forge-r").reply_to)
    forger = Forger(P.notify_port)
    try:
        forger.send(Heartbeat("tx-forge-r", 9, 0, reply_port=9))  # "send my grants to me"
        forger.send(Release("tx-forge-r", consumer_tp_size=1))
        assert wait_for(lambda: forged_count(P, "send") == 2, [P])
        assert "p-1" in P.scheduler.requests and P.reported_sending == []
        assert P.worker._worker.directory.get("tx-forge-r").reply_to == grants_to
    finally:
        forger.close()
    # The stalled read times out; D recomputes and releases P itself.
    assert run_until(
        [P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and P.empty() and D.empty(), 20
    )
    assert D.outputs["d-1"] == expected and P.reported_sending == ["p-1"]


def test_with_binding_off_any_sender_is_believed_as_before(make_instance):
    D = make_instance("D", "kv_consumer", extra={"bind_peers": False})
    P = make_instance("P", "kv_producer")
    D.scheduler.recompute_kv_load_failures = True
    _, to_d = write_pair_params("tx-open", P, D)
    D.add("d-1", PROMPT, TOKENS, to_d)
    for _ in range(3):
        D.step()
    forger = Forger(D.notify_port)
    try:
        forger.send(WriteFailed("tx-open", reason="believed", writes_stopped=True))
        assert run_until([D], lambda: D.load_errors != set(), 5)  # the documented trade-off
    finally:
        forger.close()


def test_read_mode_a_release_forged_before_d_speaks_costs_d_its_load_never_its_answer(
    make_instance,
):
    """P in READ mode learns its D from D's first message: a forger who speaks first can end
    the transfer, but D reads only under a lease from P, so it computes the prompt itself."""
    expected = reference(make_instance)
    P = make_instance("P", "kv_producer", True)
    D = make_instance(
        "D",
        "kv_consumer",
        True,
        extra={"machine_config": {"read_consumer": {"setup_timeout_s": 0.5}}},
    )
    D.scheduler.recompute_kv_load_failures = True
    P.add("p-1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "tx-first"})
    assert run_until([P], lambda: "p-1" in P.params_out)
    forger = Forger(P.notify_port)
    try:
        forger.send(Release("tx-first", consumer_tp_size=1))
        assert run_until([P], lambda: P.empty(), 5)  # P believed the first speaker
    finally:
        forger.close()
    D.add("d-1", PROMPT, TOKENS, P.params_out["p-1"])
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and D.empty(), 20)
    assert D.outputs["d-1"] == expected and D.load_errors
