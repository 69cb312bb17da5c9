"""The connector against vLLM's real Scheduler, in both modes, on the paths users hit.

Each scenario runs a P and a D instance (vLLM's scheduler + the connector's halves, real
sockets, the same-host engine, real KV tensors), checks D's tokens against a single
instance that computed the prompt itself, checks the control messages on the wire, and
ends with both schedulers empty: no request, every block free, every ref count 0.
"""

from __future__ import annotations

import threading

import pytest
from harness import BLOCK_SIZE, capture_wire, run_until, write_pair_params

from moriio_fsm.adapters.zmq import (
    Heartbeat,
    LeaseGranted,
    Release,
    RemoteBlocks,
    WriteDone,
    WriteFailed,
)
from moriio_fsm.engines.same_host import iovec
from moriio_fsm.machines.bitmaps import layer_indices

pytestmark = pytest.mark.integration

PROMPT = list(range(10, 50))  # 40 tokens: three blocks, the last one partial
LONG_PROMPT = list(range(100, 230))  # 130 tokens: chunked prefill (64 tokens a step)
TOKENS = 5


def reference(make_instance, prompt, tokens=TOKENS):
    single = make_instance("single", "kv_consumer")
    single.add("ref", prompt, tokens, None)
    assert run_until([single], lambda: len(single.outputs.get("ref", [])) >= tokens)
    return single.outputs["ref"]


def both_empty(*instances):
    return all(instance.empty() for instance in instances)


def messages(sent, kind):
    return [message for _, message in sent if type(message) is kind]


# -- WRITE mode ----------------------------------------------------------------------------


def test_write_happy_path_is_token_identical_and_leaves_both_schedulers_empty(make_instance):
    expected = reference(make_instance, PROMPT)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    p_wire, d_wire = capture_wire(P), capture_wire(D)
    to_p, to_d = write_pair_params("tx-w1", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    # D told P where its three blocks are, once; P answered write_done, once.
    blocks = messages(d_wire, RemoteBlocks)
    assert len(blocks) == 1 and blocks[0].transfer_id == "tx-w1" and blocks[0].req_id == "d-1"
    assert len(blocks[0].block_ids) == 3 and blocks[0].decode_rank == 0
    assert d_wire[0][0] == ("127.0.0.1", P.notify_port)
    done = messages(p_wire, WriteDone)
    assert [(m.transfer_id, m.num_writers, m.producer_rank) for m in done] == [("tx-w1", 1, 0)]
    assert p_wire[0][0] == ("127.0.0.1", D.notify_port)
    assert P.reported_sending == ["p-1"] and D.reported_recving == ["d-1"]


@pytest.mark.parametrize("posting", ["layerwise", "after_forward"])
def test_write_posting_decides_when_p_posts_a_layer_and_both_give_the_same_tokens(
    make_instance, posting, monkeypatch
):
    expected = reference(make_instance, PROMPT)
    P = make_instance("P", "kv_producer", extra={"write_posting": posting})
    D = make_instance("D", "kv_consumer")
    # One transfer first, so the link to D is up when the measured one posts: until it is, the
    # layers go one by one from the handshake's thread, which is not what this test is about.
    warm_p, warm_d = write_pair_params("tx-posting-warm", P, D)
    P.add("p-0", PROMPT, 1, warm_p)
    D.add("d-0", PROMPT, TOKENS, warm_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-0", [])) >= TOKENS and both_empty(P, D))
    worker = P.worker._worker
    timeline: list[str] = []
    steps: list[str] = []  # the scheduling events, one per dispatch
    dispatch = worker.dispatch

    def recording(side, event):
        if event.kind == "layer_scheduled":
            timeline.append(f"scheduled {event.layer}")
            steps.append(event.kind)
        elif event.kind == "layers_scheduled":
            timeline.extend(f"scheduled {layer}" for layer in layer_indices(event.layers))
            steps.append(event.kind)
        return dispatch(side, event)

    worker.dispatch = recording
    save_layer, finish_saves = worker.save_layer, worker.finish_saves
    worker.save_layer = lambda name: (timeline.append(f"saved {name}"), save_layer(name))[1]
    worker.finish_saves = lambda: (timeline.append("forward ended"), finish_saves())[1]
    # Every copy the engine makes: P's KV pages are shared, so each is a memory copy in P.
    engine = P.worker._worker.engine
    copies, kernel_calls = [], []
    for strategy in (engine._pages, engine._kernel):
        monkeypatch.setattr(
            strategy,
            "move",
            lambda *call, move=strategy.move, name=strategy.name: (
                copies.append(name),
                move(*call),
            )[1],
        )
    real = iovec.SYSCALLS["write"]
    monkeypatch.setitem(
        iovec.SYSCALLS, "write", lambda *call: (kernel_calls.append(call), real(*call))[1]
    )
    to_p, to_d = write_pair_params("tx-posting", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    layers = [name for name in timeline if name.startswith("scheduled")]
    assert len(layers) == len(set(layers)) == len(P.kv)  # every layer once
    ended = timeline.index("forward ended")
    first = timeline.index(layers[0])
    if posting == "layerwise":
        # Each layer goes as soon as it is saved: the first long before the forward ends.
        assert timeline[first - 1].startswith("saved") and first < ended
        assert steps == ["layer_scheduled"] * len(P.kv)
    else:
        assert first > ended  # nothing goes during the forward
        assert steps == ["layers_scheduled"]  # the forward's layers in one step
        # ... and then every layer's ranges go in one run of memory copies, none by the kernel.
        assert copies == ["shared_pages"] and kernel_calls == []


def warmed_pair_watching_sessions(make_instance, monkeypatch, tid: str):
    """P (posting after its forward) and D after one transfer (the handshake, once), with P's
    session creations recorded: (made on the forward thread, forwards ended before it)."""
    P = make_instance("P", "kv_producer", extra={"write_posting": "after_forward"})
    D = make_instance("D", "kv_consumer")
    warm_p, warm_d = write_pair_params(tid, P, D)
    P.add("p-0", PROMPT, 1, warm_p)
    D.add("d-0", PROMPT, TOKENS, warm_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-0", [])) >= TOKENS and both_empty(P, D))
    worker = P.worker._worker
    made, timeline = [], []
    create = worker.engine.create_session
    monkeypatch.setattr(
        worker.engine,
        "create_session",
        lambda *a: (
            made.append((threading.current_thread() is threading.main_thread(), len(timeline))),
            create(*a),
        )[1],
    )
    finish_saves = worker.finish_saves
    monkeypatch.setattr(
        worker, "finish_saves", lambda: (timeline.append("forward ended"), finish_saves())[1]
    )
    return P, D, worker, made


def test_d_blocks_known_during_ps_forward_leave_only_the_posts_for_after_it(
    make_instance, monkeypatch
):
    """D's remote_blocks reach P while its forward runs: P's I/O thread makes the transfer's
    sessions then, so the posts after the forward make none, and the tokens are the same."""
    expected = reference(make_instance, PROMPT)
    P, D, worker, made = warmed_pair_watching_sessions(
        make_instance, monkeypatch, "tx-prepare-warm"
    )
    forward = P._forward

    def slow_forward(out):
        if out.total_num_scheduled_tokens and "p-1" in out.num_scheduled_tokens:
            # P's forward takes long enough for D to allocate and tell P.
            assert run_until([D], lambda: len(made) == len(P.kv), timeout_s=10.0)
        return forward(out)

    monkeypatch.setattr(P, "_forward", slow_forward)
    to_p, to_d = write_pair_params("tx-prepare", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    # One session per layer, each made off the forward thread before the forward ended.
    assert len(made) == len(P.kv) and all(not on_main and at == 0 for on_main, at in made), made


def test_d_blocks_known_before_p_starts_the_transfer_are_prepared_before_ps_forward(
    make_instance, monkeypatch
):
    """D allocates before P's scheduler starts the transfer (the usual order when a proxy sends
    both at once): P's machine holds remote_blocks until prefill_started, and P makes the
    transfer's sessions then, before its forward, so the posts after the forward make none."""
    expected = reference(make_instance, PROMPT)
    P, D, worker, made = warmed_pair_watching_sessions(make_instance, monkeypatch, "tx-early-warm")
    to_p, to_d = write_pair_params("tx-early", P, D)
    D.add("d-1", PROMPT, TOKENS, to_d)

    def held():
        return any(
            s.event == "remote_blocks" and s.outcome == "buffered"
            for s in worker.recorder.records()
            if s.transfer == "tx-early"
        )

    assert run_until([D], held, timeout_s=10.0)  # D told P before P knew the transfer
    assert made == []
    P.add("p-1", PROMPT, 1, to_p)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    assert len(made) == len(P.kv) and all(at == 0 for _, at in made), made


def test_completions_of_layers_posted_together_carry_the_time_their_copy_ended(
    make_instance, monkeypatch
):
    """After the forward every layer's write is copied in one go: each completion event is made
    when the copies ended, before any is dispatched, not after the dispatches of those before it."""
    # The link is up before the transfer, so its layers are posted together after the forward.
    P, D, worker, _ = warmed_pair_watching_sessions(make_instance, monkeypatch, "tx-stamps-warm")
    worker.engine.inline_copies = (
        True  # as on one core: the copies end inside the posting thread's flush
    )
    seen = []  # (kind, event time, time its dispatch began)
    dispatch = worker.dispatch
    monkeypatch.setattr(
        worker,
        "dispatch",
        lambda side, event: (
            seen.append((event.kind, event.time, worker.clock())),
            dispatch(side, event),
        )[1],
    )
    to_p, to_d = write_pair_params("tx-stamps", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    completions = [(made, began) for kind, made, began in seen if kind == "layer_write_completed"]
    assert len(completions) == len(P.kv)
    first_dispatch = completions[0][1]
    assert all(made <= first_dispatch for made, _ in completions)


def recorded_help(monkeypatch, worker):
    """Every help_writers call of ``worker``'s engine: (how long it may wait, step idle, load pending) at the call."""
    calls = []
    help_writers = worker.engine.help_writers

    def recording(wait_s=None, linger_s=None):
        waits = worker.engine.tuning.assist_wait_s if wait_s is None else wait_s
        calls.append((waits, worker._step_idle, worker.reports.loads_pending()))
        return help_writers(wait_s, linger_s)

    monkeypatch.setattr(worker.engine, "help_writers", recording)
    return calls


@pytest.mark.parametrize("posting", ["layerwise", "after_forward"])
def test_every_write_through_ds_board_gives_the_same_tokens_and_d_helps_only_on_idle_steps(
    make_instance, monkeypatch, posting
):
    """Copy assist on: P puts each layer's write on D's board, D helps from its steps and waits
    for writes only on a step with no forward while its load is pending."""
    expected = reference(make_instance, PROMPT)
    P = make_instance("P", "kv_producer", extra={"write_posting": posting})
    D = make_instance("D", "kv_consumer")
    engine = P.worker._worker.engine
    monkeypatch.setattr(
        engine.tuning, "assist_min_bytes", 0
    )  # this KV is small: every write goes on the board
    alone = []  # copies P made without D's board
    for strategy in (engine._pages, engine._kernel):
        monkeypatch.setattr(
            strategy,
            "move",
            lambda *call, move=strategy.move, name=strategy.name: (alone.append(name), move(*call))[
                1
            ],
        )
    calls = recorded_help(monkeypatch, D.worker._worker)
    to_p, to_d = write_pair_params("tx-assist", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    # Every write went through D's board: in one job per write, or fewer where the engine
    # copied writes posted close together as one (how they group depends on timing).
    assert engine.assist_counts["jobs"] >= 1 and alone == []
    # Asked only on steps with no forward while the load was pending, and asked then.
    assert calls and all(wait > 0 and idle and pending for wait, idle, pending in calls)


def test_in_read_mode_d_never_asks_to_help_writes(make_instance, monkeypatch):
    expected = reference(make_instance, PROMPT)
    P, D = make_instance("P", "kv_producer", True), make_instance("D", "kv_consumer", True)
    calls = recorded_help(monkeypatch, D.worker._worker)
    P.add("p-1", PROMPT, 1, read_p_params(P, "tx-r-assist"))
    assert run_until([P], lambda: "p-1" in P.params_out)
    D.add("d-1", PROMPT, TOKENS, P.params_out["p-1"])
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    assert calls == []


def test_write_with_chunked_prefill_sends_only_after_the_whole_prompt(make_instance):
    expected = reference(make_instance, LONG_PROMPT)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    p_wire = capture_wire(P)
    to_p, to_d = write_pair_params("tx-w2", P, D)
    P.add("p-1", LONG_PROMPT, 1, to_p)
    D.add("d-1", LONG_PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    assert len(messages(p_wire, WriteDone)) == 1


def test_d_aborts_while_waiting_for_remote_kv_keeps_its_blocks_until_p_answers(make_instance):
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    to_p, to_d = write_pair_params("tx-w3", P, D)
    D.add("d-1", PROMPT, TOKENS, to_d)
    for _ in range(3):
        D.step()  # allocated, WAITING_FOR_REMOTE_KVS, blocks announced
    assert D.scheduler.requests["d-1"].status.name == "WAITING_FOR_REMOTE_KVS"
    D.abort("d-1")
    for _ in range(20):
        D.step()
    # P has not written yet and may still: D must not have handed the blocks back.
    assert "d-1" in D.scheduler.requests and not D.empty()
    P.add("p-1", PROMPT, 1, to_p)
    assert run_until([P, D], lambda: both_empty(P, D))
    assert D.outputs.get("d-1", []) == []
    assert D.reported_recving == ["d-1"] and P.reported_sending == ["p-1"]


def test_d_aborts_before_allocation_releases_p(make_instance):
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    d_wire = capture_wire(D)
    to_p, to_d = write_pair_params("tx-w4", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    D.abort("d-1")  # before D's scheduler ever allocated
    assert run_until([P, D], lambda: both_empty(P, D))
    releases = messages(d_wire, Release)
    assert [r.transfer_id for r in releases] == ["tx-w4"]
    assert D.reported_recving == []  # vLLM never waited for this load
    assert P.reported_sending == ["p-1"]


def test_p_aborts_during_chunked_prefill_tells_d_and_d_recomputes(make_instance):
    expected = reference(make_instance, LONG_PROMPT)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    D.scheduler.recompute_kv_load_failures = True  # kv_load_failure_policy=recompute
    p_wire = capture_wire(P)
    to_p, to_d = write_pair_params("tx-w5", P, D)
    D.add("d-1", LONG_PROMPT, TOKENS, to_d)
    P.add("p-1", LONG_PROMPT, 1, to_p)
    P.step()  # the first of three prefill chunks
    assert P.scheduler.requests["p-1"].num_computed_tokens < len(LONG_PROMPT)
    P.abort("p-1")
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    failed = messages(p_wire, WriteFailed)
    assert failed and (failed[0].transfer_id, failed[0].reason) == ("tx-w5", "aborted")
    # D's release after it asks P again; P says the same (or, having ended, "ended").
    assert all(m.writes_stopped and m.reason in ("aborted", "ended") for m in failed[1:])
    assert D.outputs["d-1"] == expected  # recomputed after the failed load, still right
    assert P.reported_sending == []  # P's blocks were never held for a write


def test_p_aborted_before_d_allocated_fails_ds_load_at_its_allocation(make_instance):
    """P's request ends before its transfer started and before D's scheduler allocated:
    P's write_failed reaches D before D's transfer exists (D holds it), and D fails its
    load as soon as it allocates, instead of waiting out its write timeout."""
    expected = reference(make_instance, LONG_PROMPT)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    D.scheduler.recompute_kv_load_failures = True
    to_p, to_d = write_pair_params("tx-w5-early", P, D)
    P.add("p-1", LONG_PROMPT, 1, to_p)
    P.step()  # the first of three prefill chunks
    P.abort("p-1")
    P.step()  # P ends the transfer it never started: D hears write_failed
    d_worker = D.worker._worker

    def held():
        return any(
            s.event == "write_failed" and s.outcome == "buffered"
            for s in d_worker.recorder.records()
            if s.transfer == "tx-w5-early"
        )

    assert run_until([P], held, timeout_s=10.0)
    D.add("d-1", LONG_PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected  # recomputed after the failed load
    assert D.load_errors


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_write_is_handled_by_the_load_failure_policy(make_instance, policy):
    expected = reference(make_instance, PROMPT)
    P, D = make_instance("P", "kv_producer"), make_instance("D", "kv_consumer")
    D.scheduler.recompute_kv_load_failures = policy == "recompute"
    to_p, to_d = write_pair_params("tx-w6", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    for _ in range(4):
        D.step()  # D's remote_blocks reach P's listener
    P.worker._worker.engine.faults.fail_nth(1)  # the first layer's write fails
    finished = (
        (lambda: len(D.outputs.get("d-1", [])) >= TOKENS)
        if policy == "recompute"
        else (lambda: "d-1" not in D.scheduler.requests)
    )
    assert run_until([P, D], lambda: finished() and both_empty(P, D))
    assert D.load_errors  # the failed blocks were reported to vLLM
    if policy == "recompute":
        assert D.outputs["d-1"] == expected
    else:
        assert D.outputs.get("d-1", []) == []


def test_a_p_that_never_answers_ends_in_a_failed_load_not_a_hang(make_instance):
    expected = reference(make_instance, PROMPT)
    # D waits write_timeout for P, then keeps its blocks for the safety timeout (P may still
    # be writing) before it reports the load failed.
    D = make_instance(
        "D",
        "kv_consumer",
        extra={
            "machine_config": {
                "write_consumer": {"write_timeout_s": 0.5, "safety_timeout_s": 1.0},
                # P's drain, which D's safety timeout must outlast, as short (D runs no P here)
                "write_producer": {"transfer_timeout_s": 0.4, "abandon_timeout_s": 0.4},
            }
        },
    )
    D.scheduler.recompute_kv_load_failures = True
    silent_p = {
        "do_remote_prefill": True,
        "transfer_id": "tx-w7",
        "remote_host": "127.0.0.1",
        "remote_notify_port": 9,
        "remote_handshake_port": 9,
    }  # nobody listens there
    D.add("d-1", PROMPT, TOKENS, silent_p)
    assert run_until([D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and D.empty(), 20)
    assert D.outputs["d-1"] == expected
    assert D.load_errors


def drop_first(instance, kind) -> list:
    """Lose the instance's first control message of type ``kind``; record every other."""
    sent: list = []
    transport = instance.worker._worker.transport
    original = transport.send

    def send(destination, message):
        if type(message) is kind and not any(type(m) is kind for _, m in sent):
            sent.append((tuple(destination), None))  # lost on the way
            return
        sent.append((tuple(destination), message))
        original(destination, message)

    transport.send = send
    return sent


def test_a_lost_write_done_is_answered_again_when_d_releases_and_no_block_is_kept(
    make_instance,
):
    """P's write_done is lost; D times out and releases; P (whose transfer ended) says its
    writes stopped; D recomputes, and its blocks go back instead of into quarantine."""
    expected = reference(make_instance, PROMPT)
    P = make_instance("P", "kv_producer")
    D = make_instance(
        "D",
        "kv_consumer",
        extra={
            "machine_config": {
                "write_consumer": {
                    "write_timeout_s": 0.5,
                    "safety_timeout_s": 45.0,  # past P's drain: never reached here
                    "release_repeat_s": 0.3,
                },
            }
        },
    )
    D.scheduler.recompute_kv_load_failures = True
    p_wire, d_wire = drop_first(P, WriteDone), capture_wire(D)
    to_p, to_d = write_pair_params("tx-w8", P, D)
    P.add("p-1", PROMPT, 1, to_p)
    D.add("d-1", PROMPT, TOKENS, to_d)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    assert messages(d_wire, Release), "D never released"
    [answer] = [m for m in messages(p_wire, WriteFailed) if m.transfer_id == "tx-w8"][:1]
    assert answer.reason == "ended" and answer.writes_stopped is True
    stats = D.worker._worker.drivers["receive"].table.stats()
    assert stats["anomalies"] == 0 and stats["ended"] == {"failed": 1}


# -- READ mode -----------------------------------------------------------------------------


def read_p_params(P, tid):
    return {"do_remote_decode": True, "transfer_id": tid}


def test_read_happy_path_is_token_identical_and_leaves_both_schedulers_empty(make_instance):
    expected = reference(make_instance, PROMPT)
    P, D = make_instance("P", "kv_producer", True), make_instance("D", "kv_consumer", True)
    p_wire, d_wire = capture_wire(P), capture_wire(D)
    P.add("p-1", PROMPT, 1, read_p_params(P, "tx-r1"))
    assert run_until([P], lambda: "p-1" in P.params_out)
    params = P.params_out["p-1"]
    assert params["do_remote_prefill"] is True and params["transfer_id"] == "tx-r1"
    assert len(params["remote_block_ids"]) == 3 and params["remote_notify_port"] == P.notify_port
    assert "p-1" in P.scheduler.requests  # P holds the blocks for D's reads
    D.add("d-1", PROMPT, TOKENS, params)
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected
    beats = messages(d_wire, Heartbeat)
    assert beats and beats[0].reply_port == D.worker._worker.transport.notify_port
    assert [m.seq for m in messages(p_wire, LeaseGranted)][:1] == [beats[0].seq]
    assert [r.transfer_id for r in messages(d_wire, Release)] == ["tx-r1"]
    assert P.reported_sending == ["p-1"] and D.reported_recving == ["d-1"]


def test_read_prefix_hit_on_d_reads_only_the_missing_blocks(make_instance):
    expected = reference(make_instance, PROMPT + [7, 8, 9])
    P = make_instance("P", "kv_producer", True)
    D = make_instance("D", "kv_consumer", True, prefix_caching=True)
    # D computed a request sharing the first two blocks before.
    D.add("warm", PROMPT[: 2 * BLOCK_SIZE] + [1], 1, None)
    assert run_until([D], lambda: "warm" in D.outputs and D.empty())
    P.add("p-1", PROMPT + [7, 8, 9], 1, read_p_params(P, "tx-r2"))
    assert run_until([P], lambda: "p-1" in P.params_out)
    D.add("d-1", PROMPT + [7, 8, 9], TOKENS, P.params_out["p-1"])
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    assert D.outputs["d-1"] == expected


def test_read_p_lease_expires_when_d_never_reads(make_instance):
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
    P.add("p-1", PROMPT, 1, read_p_params(P, "tx-r3"))
    assert run_until([P], lambda: "p-1" in P.params_out)
    assert not P.empty()
    assert run_until([P], lambda: P.empty(), 10)  # the lease ran out: blocks back
    assert P.reported_sending == ["p-1"]


def test_read_d_aborts_while_reading_and_both_end_empty(make_instance):
    P = make_instance("P", "kv_producer", True)
    D = make_instance(
        "D",
        "kv_consumer",
        True,
        extra={"machine_config": {"read_consumer": {"read_timeout_s": 1.0}}},
    )
    P.add("p-1", PROMPT, 1, read_p_params(P, "tx-r4"))
    assert run_until([P], lambda: "p-1" in P.params_out)
    D.worker._worker.engine.faults.stall_nth(1)  # one read never completes on its own
    D.add("d-1", PROMPT, TOKENS, P.params_out["p-1"])
    for _ in range(5):
        D.step()
        P.step()
    D.abort("d-1")
    assert run_until([P, D], lambda: both_empty(P, D), 20)
    assert D.outputs.get("d-1", []) == []


def test_read_with_a_p_that_is_gone_fails_the_load_and_recomputes(make_instance):
    expected = reference(make_instance, PROMPT)
    D = make_instance(
        "D",
        "kv_consumer",
        True,
        extra={"machine_config": {"read_consumer": {"setup_timeout_s": 0.5}}},
    )
    D.scheduler.recompute_kv_load_failures = True
    gone = {
        "do_remote_prefill": True,
        "transfer_id": "tx-r5",
        "remote_block_ids": [1, 2, 3],
        "remote_engine_id": "P",
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 9,
        "remote_notify_port": 9,
    }
    D.add("d-1", PROMPT, TOKENS, gone)
    assert run_until([D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and D.empty(), 20)
    assert D.outputs["d-1"] == expected
    assert D.load_errors


# -- hostile input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {
            "do_remote_prefill": True,
            "transfer_id": "x" * 500,
            "remote_host": "127.0.0.1",
            "remote_notify_port": 1,
            "remote_handshake_port": 1,
        },
        {
            "do_remote_prefill": True,
            "transfer_id": "tx",
            "remote_host": "127.0.0.1",
            "remote_notify_port": "many",
            "remote_handshake_port": 1,
        },
        {"do_remote_prefill": "yes", "transfer_id": "tx"},
        {"do_remote_prefill": True, "do_remote_decode": True, "transfer_id": "tx"},
        {"do_remote_prefill": True, "transfer_id": "tx"},  # no peer address at all
    ],
)
def test_bad_transfer_params_compute_the_prompt_locally_and_never_crash(make_instance, params):
    expected = reference(make_instance, PROMPT)
    D = make_instance("D", "kv_consumer")
    D.add("d-1", PROMPT, TOKENS, params)
    assert run_until([D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and D.empty())
    assert D.outputs["d-1"] == expected


@pytest.mark.parametrize("inline", [False, True])
def test_a_read_whose_layers_complete_at_once_leaves_no_transfer_in_the_metrics(
    make_instance, monkeypatch, inline
):
    # On one core the engine copies as D posts, so the layers complete inside the dispatch
    # that posted them: the metrics must still see that dispatch's steps before the end.
    import os

    if inline:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    P, D = make_instance("P", "kv_producer", True), make_instance("D", "kv_consumer", True)
    assert D.worker._worker.engine.inline_copies is inline
    P.add("p-1", PROMPT, 1, {"do_remote_decode": True, "transfer_id": "tx-metrics"})
    assert run_until([P], lambda: "p-1" in P.params_out)
    D.add("d-1", PROMPT, TOKENS, P.params_out["p-1"])
    assert run_until([P, D], lambda: len(D.outputs.get("d-1", [])) >= TOKENS and both_empty(P, D))
    for instance in (P, D):
        metrics = instance.worker._worker.metrics
        assert not metrics._live, f"{instance.name} still tracks {dict(metrics._live)}"
