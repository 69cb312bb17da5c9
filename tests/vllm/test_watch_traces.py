"""Watched runs leave traces in the project's format: P's and D's files join by the transfer
key, and ``replay``, ``explain`` and ``export-trace`` read them; ``explain`` on a stuck load
says which side stopped and in which state. The watch machines pass validate and check."""

from __future__ import annotations

import json

from harness import write_pair_params
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request
from watch_harness import WatchInstance

from moriio_fsm.cli import main
from moriio_fsm.machines import spec_path
from moriio_fsm.vllm.watch_keys import consumer_key, producer_key

PROMPT = list(range(10, 50))
WATCH_SPECS = ("watch_consumer", "watch_producer", "watch_worker")


def stuck_run(tiny_model, folder):
    """P prefills and sends; D's workers never report the load: D is stuck loading."""
    p = WatchInstance(
        "P", "kv_producer", False, tiny_model, watch={"trace_file": str(folder / "P.jsonl")}
    )
    d = WatchInstance(
        "D",
        "kv_consumer",
        False,
        tiny_model,
        watch={"trace_file": str(folder / "{engine_id}.jsonl"), "stuck_after_s": 5.0},
    )
    try:
        to_p, to_d = write_pair_params("tx-stuck", p, d)
        p.add("req-p", PROMPT, 1, to_p)
        d.add("req-d", PROMPT, 4, to_d)
        p.step()
        d.step()  # D's load starts; D is never stepped again
        watch = d.scheduler_connector.scheduler_watch
        watch._settled("consumer", watch.drivers["consumer"].advance(watch.clock() + 6.0))
        assert watch.anomalies.counts["stuck_load"] == 1
    finally:
        for instance in (p, d):
            instance.close()
            instance.scheduler_connector.shutdown()
            instance.scheduler_connector.scheduler_watch.recorder.close()
    return folder / "P.jsonl", folder / "D.jsonl"


def test_explain_on_a_stuck_load_names_the_side_that_stopped_and_its_state(
    tiny_model, tmp_path, capsys
):
    p_file, d_file = stuck_run(tiny_model, tmp_path)
    # Exit 1: the transfer is stuck on a side.
    assert main(["explain", str(p_file), str(d_file), "--transfer", "tx-stuck"]) == 1
    out = capsys.readouterr().out
    assert "2 side(s)" in out  # both files joined on the transfer key
    assert "D-dp0/watch_consumer 'tx-stuck' is stuck in 'loading'" in out
    assert "note_anomaly" in out


def test_replay_and_export_read_watched_traces(tiny_model, tmp_path, capsys):
    p_file, d_file = stuck_run(tiny_model, tmp_path)
    assert main(["replay", str(p_file), str(d_file)]) in (0, 1)
    out = capsys.readouterr().out
    assert "replayed" in out and "mismatch" not in out.lower()
    exported = tmp_path / "trace.json"
    assert main(["export-trace", str(p_file), str(d_file), "-o", str(exported)]) == 0
    names = {event.get("name") for event in json.loads(exported.read_text())["traceEvents"]}
    assert any("loading" in str(name) for name in names)


def test_the_watch_machines_validate_and_pass_the_model_checker(capsys):
    assert main(["validate", *(str(spec_path(name)) for name in WATCH_SPECS)]) == 0
    assert main(["check", *WATCH_SPECS]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") >= 2 * len(WATCH_SPECS)


def _request(request_id: str, params: dict | object) -> Request:
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(request_id, [1, 2, 3], sampling, None)


def test_without_a_transfer_id_p_and_d_join_on_the_request_id_p_gave_d():
    # NIXL's shape: P's answer carries P's request id, which D's request holds.
    p_request = _request("p-internal-7", {"do_remote_decode": True})
    d_request = _request(
        "d-internal-9", {"do_remote_prefill": True, "remote_request_id": "p-internal-7"}
    )
    assert producer_key(p_request) == consumer_key(d_request) == "p-internal-7"
    with_id = _request("d-1", {"do_remote_prefill": True, "transfer_id": "tx-9"})
    assert consumer_key(with_id) == "tx-9"


def test_ill_typed_params_fall_back_to_the_request_id():
    for junk in ([1, 2], "tx", 7, {"transfer_id": 12}, {"transfer_id": "x" * 10_000}):
        assert consumer_key(_request("r-1", junk)) == "r-1"
