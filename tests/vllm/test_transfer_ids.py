"""One transfer id drives one request: ids reused at once or later never cross or hang loads.

A client talking to vLLM directly, or a proxy that reuses ids, can give two requests one
``transfer_id``. Each scenario runs vLLM's real schedulers with the connector (real sockets,
real KV tensors) and checks what a user would see: every answer is the single instance's
(or a clear failure under the ``fail`` policy), nothing waits for ever, and both schedulers
end empty: no request, every block free.
"""

from __future__ import annotations

import pytest
from harness import capture_wire, run_until, write_pair_params

from moriio_fsm.adapters.zmq import WriteFailed
from moriio_fsm.vllm.metadata import ReceiveStart, StepMetadata
from moriio_fsm.vllm.params import PeerAddress
from moriio_fsm.vllm.transfer_ids import TransferIdLedger, prompt_digest

pytestmark = pytest.mark.integration

PROMPT_A = list(range(10, 50))  # 40 tokens: three blocks
PROMPT_B = list(range(300, 340))  # as long, other tokens: its KV differs everywhere
TOKENS = 5


def reference(make_instance, *prompts):
    single = make_instance("single", "kv_consumer")
    for index, prompt in enumerate(prompts):
        single.add(f"ref-{index}", prompt, TOKENS, None)
    assert run_until(
        [single],
        lambda: all(len(single.outputs.get(f"ref-{i}", [])) >= TOKENS for i in range(len(prompts))),
    )
    return [single.outputs[f"ref-{i}"] for i in range(len(prompts))]


def both_empty(*instances):
    return all(instance.empty() for instance in instances)


def decoded(D, *request_ids):
    return lambda: all(len(D.outputs.get(r, [])) >= TOKENS for r in request_ids)


def test_two_live_requests_on_d_with_one_id_each_get_their_own_answer(make_instance):
    want_a, want_b = reference(make_instance, PROMPT_A, PROMPT_B)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    to_p, to_d = write_pair_params("tx-same", P, D)
    D.add("d-a", PROMPT_A, TOKENS, dict(to_d))
    D.add("d-b", PROMPT_B, TOKENS, dict(to_d))  # the same id, another prompt
    P.add("p-a", PROMPT_A, 1, to_p)
    assert run_until([P, D], lambda: decoded(D, "d-a", "d-b")() and both_empty(P, D))
    assert D.outputs["d-a"] == want_a  # loaded from P
    assert D.outputs["d-b"] == want_b  # refused at once: computed locally
    assert D.reported_recving == ["d-a"]
    assert D.scheduler.connector._scheduler.counts["transfer_ids_refused"] == 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_p_never_writes_one_prompts_kv_into_blocks_d_allocated_for_another(make_instance, policy):
    """D admits the id for prompt A while P admits it for prompt B (the other request with
    that id went to each first): P must not write B's KV into A's blocks."""
    (want_a,) = reference(make_instance, PROMPT_A)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    D.scheduler.recompute_kv_load_failures = policy == "recompute"
    p_wire = capture_wire(P)
    to_p, to_d = write_pair_params("tx-cross", P, D)
    P.add("p-b", PROMPT_B, 1, dict(to_p))  # P's transfer for this id is prompt B's
    P.add("p-a", PROMPT_A, 1, dict(to_p))  # refused by P: the id is taken
    D.add("d-a", PROMPT_A, TOKENS, to_d)  # D allocates for prompt A
    finished = (
        decoded(D, "d-a") if policy == "recompute" else (lambda: "d-a" not in D.scheduler.requests)
    )
    assert run_until([P, D], lambda: finished() and both_empty(P, D))
    failed = [
        (m.transfer_id, m.reason, m.writes_stopped) for _, m in p_wire if type(m) is WriteFailed
    ]
    assert failed[0] == ("tx-cross", "prompt_mismatch", True)
    # D's release asks again; P says the same (or, having ended, "ended").
    assert set(failed[1:]) <= {("tx-cross", "prompt_mismatch", True), ("tx-cross", "ended", True)}
    assert D.load_errors  # the load failed through vLLM's policy
    if policy == "recompute":
        assert D.outputs["d-a"] == want_a  # never B's KV
    else:
        assert D.outputs.get("d-a", []) == []
    assert P.worker._worker.metrics.snapshot()["bytes"] == []  # not one write was posted


def test_an_id_reused_after_its_transfer_ended_is_refused_not_left_waiting(make_instance):
    want_a, want_b = reference(make_instance, PROMPT_A, PROMPT_B)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    to_p, to_d = write_pair_params("tx-again", P, D)
    P.add("p-1", PROMPT_A, 1, dict(to_p))
    D.add("d-1", PROMPT_A, TOKENS, dict(to_d))
    assert run_until([P, D], lambda: decoded(D, "d-1")() and both_empty(P, D))
    assert D.outputs["d-1"] == want_a
    # The same id again, for another prompt: no machine can take it any more.
    P.add("p-2", PROMPT_B, 1, dict(to_p))
    D.add("d-2", PROMPT_B, TOKENS, dict(to_d))
    assert run_until([P, D], lambda: decoded(D, "d-2")() and both_empty(P, D), 10)
    assert D.outputs["d-2"] == want_b
    assert D.reported_recving == ["d-1"] and P.reported_sending == ["p-1"]
    assert D.scheduler.connector._scheduler.counts["transfer_ids_refused"] == 1
    assert P.scheduler.connector._scheduler.counts["transfer_ids_refused"] == 1
    assert not D.worker._worker.reports.loads_pending()


def test_read_mode_p_refuses_a_second_live_request_with_the_id_and_gives_it_no_blocks(
    make_instance,
):
    (want_a,) = reference(make_instance, PROMPT_A)
    P, D = make_instance("P", "kv_producer", True), make_instance("D", "kv_consumer", True)
    P.add("p-a", PROMPT_A, 1, {"do_remote_decode": True, "transfer_id": "tx-r"})
    P.add("p-b", PROMPT_B, 1, {"do_remote_decode": True, "transfer_id": "tx-r"})
    assert run_until([P], lambda: "p-a" in P.params_out and "p-b" in P.outputs)
    assert "p-b" not in P.params_out  # no blocks a D could read
    D.add("d-a", PROMPT_A, TOKENS, P.params_out["p-a"])
    assert run_until([P, D], lambda: decoded(D, "d-a")() and both_empty(P, D))
    assert D.outputs["d-a"] == want_a
    assert P.params_out["p-a"]["prompt_digest"] == prompt_digest(PROMPT_A)


def test_read_mode_d_refuses_blocks_that_hold_another_prompt(make_instance):
    (want_b,) = reference(make_instance, PROMPT_B)
    P = make_instance(
        "P",
        "kv_producer",
        True,
        extra={
            "machine_config": {
                "read_producer": {"lease_s": 0.3},
                # D's read budget, which P's lease must outlast, as short (P runs no D here)
                "read_consumer": {"read_timeout_s": 0.1, "lease_margin_s": 0.1},
            }
        },
    )
    D = make_instance("D", "kv_consumer", True)
    P.add("p-a", PROMPT_A, 1, {"do_remote_decode": True, "transfer_id": "tx-r2"})
    assert run_until([P], lambda: "p-a" in P.params_out)
    D.add("d-b", PROMPT_B, TOKENS, P.params_out["p-a"])  # A's blocks offered for prompt B
    assert run_until([D], lambda: decoded(D, "d-b")())
    assert D.outputs["d-b"] == want_b  # computed locally, not read from A's blocks
    assert D.reported_recving == []
    assert run_until([P, D], lambda: both_empty(P, D), 10)  # P's unread lease ran out
    assert len(D.worker._worker.directory) == 0  # nothing kept for a load not made


@pytest.mark.parametrize("order", ["d_allocates_first", "p_refuses_first"])
def test_a_d_that_never_saw_the_id_hears_at_once_that_p_used_it_before(make_instance, order):
    """A retry reuses an id only P remembers (its first D is gone): P refuses the request,
    and the new D, which allocated for it, is told so instead of waiting for its timeouts."""
    want_a, want_b = reference(make_instance, PROMPT_A, PROMPT_B)
    P, D1 = make_instance("P", "kv_producer"), make_instance("D1", "kv_consumer")
    to_p, to_d = write_pair_params("tx-retry", P, D1)
    P.add("p-1", PROMPT_A, 1, dict(to_p))
    D1.add("d-1", PROMPT_A, TOKENS, dict(to_d))
    assert run_until([P, D1], lambda: decoded(D1, "d-1")() and both_empty(P, D1))
    D2 = make_instance(
        "D2",
        "kv_consumer",
        extra={
            "machine_config": {
                "write_consumer": {"write_timeout_s": 60.0, "safety_timeout_s": 60.0}
            }
        },
    )  # only P's answer ends it in time
    D2.scheduler.recompute_kv_load_failures = True
    to_p2, to_d2 = write_pair_params("tx-retry", P, D2)
    if order == "d_allocates_first":
        D2.add("d-2", PROMPT_B, TOKENS, to_d2)
        for _ in range(3):
            D2.step()
        P.add("p-2", PROMPT_B, 1, to_p2)
    else:
        P.add("p-2", PROMPT_B, 1, to_p2)
        P.step()
        D2.add("d-2", PROMPT_B, TOKENS, to_d2)
    assert run_until([P, D2], lambda: decoded(D2, "d-2")() and both_empty(P, D2), 15)
    assert D2.outputs["d-2"] == want_b and D2.load_errors


def test_a_load_whose_start_the_machine_refuses_fails_at_once_instead_of_waiting(make_instance):
    (want_a,) = reference(make_instance, PROMPT_A)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    D.scheduler.recompute_kv_load_failures = True
    _, to_d = write_pair_params("tx-wide", P, D)
    D.add("d-1", PROMPT_A, TOKENS, {**to_d, "remote_tp_size": 128})  # more writers than allowed
    assert run_until([D], lambda: decoded(D, "d-1")() and D.empty(), 10)
    assert D.outputs["d-1"] == want_a and D.load_errors
    assert len(D.worker._worker.directory) == 0


# -- the worker alone, should a duplicate ever get past a scheduler -----------------------


def worker_of(instance):
    return instance.worker._worker


def receive(request_id, tid, blocks, peer):
    return StepMetadata(receives=[ReceiveStart(request_id, tid, blocks, peer)])


def test_the_worker_fails_a_second_load_with_a_live_id_at_once_and_keeps_the_first(make_instance):
    D = make_instance("D", "kv_consumer")
    worker = worker_of(D)
    peer = PeerAddress("127.0.0.1", 9, 9)
    worker.start_step(receive("d-1", "tx-w", (1, 2), peer))
    worker.start_step(receive("d-2", "tx-w", (5, 6), peer))
    _, recving = worker.finished()
    assert recving == {"d-2"} and worker.load_errors() == {5, 6}
    assert worker.directory.get("tx-w").request_id == "d-1"
    assert worker.reports.outstanding()["awaiting_recv"] == 1  # d-1 still waits for P


def test_the_worker_fails_a_load_whose_id_already_ended_instead_of_leaving_it_pending(
    make_instance,
):
    D = make_instance(
        "D",
        "kv_consumer",
        extra={
            "machine_config": {
                "write_consumer": {"write_timeout_s": 0.05, "safety_timeout_s": 0.1},
                # P's drain, which D's safety timeout must outlast, as short (D runs no P here)
                "write_producer": {"transfer_timeout_s": 0.04, "abandon_timeout_s": 0.04},
            }
        },
    )
    worker = worker_of(D)
    peer = PeerAddress("127.0.0.1", 9, 9)
    worker.start_step(receive("d-1", "tx-old", (1,), peer))
    # Nobody listens at P's address: D's timers end the transfer (a failed load).
    assert run_until([], lambda: worker.drivers["receive"].table.get("tx-old") is None, 10)
    assert worker.finished()[1] == {"d-1"} and worker.load_errors() == {1}
    worker.start_step(receive("d-2", "tx-old", (3,), peer))
    _, recving = worker.finished()
    assert recving == {"d-2"} and worker.load_errors() == {3}
    assert not worker.reports.loads_pending()


def test_the_ledger_refuses_live_and_used_ids_and_stays_bounded():
    ledger = TransferIdLedger(remember=8)
    assert ledger.claim("tx-1", "r-1") is None and ledger.claim("tx-1", "r-1") is None
    assert "r-1" in ledger.claim("tx-1", "r-2")
    ledger.finish("tx-1", "r-1")
    assert "finished" in ledger.claim("tx-1", "r-3")
    for index in range(100):
        ledger.finish(f"tx-x{index}", f"r-x{index}")
    assert len(ledger._used) == 8 and len(ledger) == 0
    assert ledger.claim("tx-1", "r-4") is None  # forgotten long after: usable again


def test_prompt_digests_tell_prompts_apart_and_refuse_what_is_not_token_ids():
    assert prompt_digest(PROMPT_A) == prompt_digest(list(PROMPT_A))
    assert prompt_digest(PROMPT_A) != prompt_digest(PROMPT_B)
    assert prompt_digest(PROMPT_A) != prompt_digest(PROMPT_A + [0])
    assert prompt_digest(None) == prompt_digest([]) == ""
    assert prompt_digest([1 << 70]) == "" and prompt_digest(["x"]) == ""
