"""The P/D proxy against stand-in servers: what P and D are sent in each mode, streaming,
round robin, instances that are down, failed transfers named in the error, hostile input."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fake_vllm import free_port, post

from moriio_fsm.serving.instances import Instance, ProxyConfig, ProxyConfigError


def test_write_mode_sends_both_parts_with_each_others_address(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D", tokens=[5, 6, 7])
    proxy = proxy_for("write", [p.spec(7101, 7102)], [d.spec(7201, 7202)])
    reply = post(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["token_ids"] == [5, 6, 7]
    tid = reply.headers["x-transfer-id"]
    (to_p,), (to_d,) = p.received, d.received
    assert to_p["max_tokens"] == 1 and to_p["stream"] is True  # D goes once P's stream opened
    assert to_p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "transfer_id": tid,
        "remote_host": "127.0.0.1",
        "remote_notify_port": 7201,
        "remote_handshake_port": 7202,
        "remote_tp_size": 1,
    }
    assert to_d["max_tokens"] == 8 and to_d["prompt"] == [1, 2, 3]
    assert to_d["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_host": "127.0.0.1",
        "remote_notify_port": 7101,
        "remote_handshake_port": 7102,
        "remote_tp_size": 1,
    }


def test_write_mode_tells_d_the_tensor_parallel_size_of_its_p(fakes, proxy_for):
    """A P with TP 2 writes from two ranks: D waits for both only when told so."""
    p, d = fakes("P", tokens=[9]), fakes("D", tokens=[5])
    proxy = proxy_for("write", [p.spec(7101, 7102) + ",tp=2"], [d.spec(7201, 7202)])
    assert post(proxy, {"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    assert d.received[0]["kv_transfer_params"]["remote_tp_size"] == 2
    assert p.received[0]["kv_transfer_params"]["remote_tp_size"] == 1


def test_read_mode_passes_ps_params_on_to_d(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.reply_params = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "transfer_id": "x"}
    proxy = proxy_for("read", [p.url], [d.url])
    reply = post(proxy, {"prompt": [1], "max_tokens": 4})
    assert reply.status_code == 200
    assert d.received[0]["kv_transfer_params"] == p.reply_params
    assert p.received[0]["kv_transfer_params"]["transfer_id"] == reply.headers["x-transfer-id"]


def test_streaming_passes_ds_events_through(fakes, proxy_for):
    p, d = fakes("P"), fakes("D", tokens=[11, 12, 13])
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/completions",
        timeout=30,
        json={"prompt": [1], "max_tokens": 3, "stream": True},
    ) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert [e["choices"][0]["token_ids"][0] for e in events if e["choices"]] == [11, 12, 13]


def test_round_robin_over_instances(fakes, proxy_for):
    ps, ds = [fakes("P0"), fakes("P1")], [fakes("D0"), fakes("D1")]
    proxy = proxy_for("read", [p.url for p in ps], [d.url for d in ds])
    for _ in range(4):
        assert post(proxy, {"prompt": [1]}).status_code == 200
    assert [len(x.received) for x in ps + ds] == [2, 2, 2, 2]


def test_a_prefill_that_is_down_is_reported_and_skipped(fakes, proxy_for):
    alive, d = fakes("P1"), fakes("D")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = proxy_for("write", [f"{dead},kv=127.0.0.1:1:2", alive.spec()], [d.spec()])
    for _ in range(3):
        reply = post(proxy, {"prompt": [1]})
        assert reply.status_code == 200
    health = httpx.get(f"{proxy.url}/health").json()
    assert [i["up"] for i in health["prefill"]] == [False, True]
    assert "ConnectError" in health["prefill"][0]["last_error"]
    assert health["counts"]["retried"] == 1  # skipped once it was known down
    assert len(alive.received) == 3


def test_no_prefill_left_is_a_503_naming_each_instance(fakes, proxy_for):
    d = fakes("D")
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = proxy_for("read", [dead], [d.url])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 503
    message = reply.json()["error"]["message"]
    assert "no prefill instance is available" in message and dead in message
    assert d.received == []  # D was never asked for a lost cause
    assert httpx.get(f"{proxy.url}/health").status_code == 503


def test_a_failed_transfer_is_an_error_naming_it_never_an_answer(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    d.status = 500
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 502
    error = reply.json()["error"]
    tid = reply.headers["x-transfer-id"]
    assert error["transfer_id"] == tid and error["type"] == "kv_transfer_failed"
    assert tid in error["message"] and "decode D0" in error["message"]


def test_an_error_event_in_ds_stream_names_the_transfer(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    d.error_event = True
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", timeout=30, json={"prompt": [1], "stream": True}
    ) as reply:
        tid = reply.headers["x-transfer-id"]
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert events[0]["error"]["transfer_id"] == tid
    assert tid in events[0]["error"]["message"]


ODD_EVENTS = {
    "choices not a list": {"id": "cmpl-1", "choices": "abc"},
    "a choice not an object": {"id": "cmpl-1", "choices": [1]},
    "text not a string": {"id": "cmpl-1", "choices": [{"text": 5}]},
    "token ids not integers": {"id": "cmpl-1", "choices": [{"token_ids": ["x"]}]},
    "token ids not a list": {"id": "cmpl-1", "choices": [{"token_ids": 7}]},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("odd", sorted(ODD_EVENTS))
def test_a_misshapen_event_from_d_is_a_502_naming_the_transfer(fakes, proxy_for, odd, stream):
    p, d = fakes("P"), fakes("D")
    d.odd_event = ODD_EVENTS[odd]
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", timeout=30, json={"prompt": [1], "stream": stream}
    ) as reply:
        tid = reply.headers["x-transfer-id"]
        if stream:
            lines = [line for line in reply.iter_lines() if line.startswith("data: {")]
            error = json.loads(lines[-1][6:])["error"]
        else:
            reply.read()
            assert reply.status_code == 502
            error = reply.json()["error"]
    assert error["transfer_id"] == tid and "wrong shape" in error["message"]
    assert httpx.get(f"{proxy.url}/health").json()["counts"]["failed"] == 1


def test_read_mode_prefill_error_fails_before_d_is_asked(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.status = 400
    proxy = proxy_for("read", [p.url], [d.url])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert (
        "prefill P0" in reply.json()["error"]["message"]
        and "400" in reply.json()["error"]["message"]
    )
    assert d.received == []


def test_write_mode_d_is_not_asked_when_p_refuses(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.status = 500
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 502 and "prefill P0" in reply.json()["error"]["message"]
    assert d.received == []  # D holds no blocks for a transfer P never started


def test_write_mode_an_unreachable_p_is_retried_before_d_is_asked(fakes, proxy_for):
    alive, d = fakes("P1"), fakes("D")
    dead = f"http://127.0.0.1:{free_port()},kv=127.0.0.1:1:2"
    proxy = proxy_for("write", [dead, alive.spec(7301, 7302)], [d.spec()])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 200
    (to_d,) = d.received  # one D request, naming the P that took the transfer
    assert to_d["kv_transfer_params"]["remote_notify_port"] == 7301


def test_write_mode_p_failing_mid_stream_ends_ds_wait_at_once(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.error_event, p.error_delay_s = True, 0.5  # P accepted, then its stream carries an error
    d.delay_s = 20.0  # D would wait for writes that never come
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    started = time.monotonic()
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 502 and "prefill P0" in reply.json()["error"]["message"]
    assert time.monotonic() - started < 10
    for _ in range(100):  # D's request was closed, so vLLM would abort it
        if d.disconnected:
            break
        time.sleep(0.05)
    assert len(d.received) == 1 and d.disconnected == 1


def test_a_non_streamed_answer_is_assembled_from_ds_stream(fakes, proxy_for):
    p, d = fakes("P"), fakes("D", tokens=[5, 6, 7])
    proxy = proxy_for("read", [p.url], [d.url])
    answer = post(proxy, {"prompt": "hello", "max_tokens": 3}).json()
    (choice,) = answer["choices"]
    assert choice["token_ids"] == [5, 6, 7] and choice["text"] == "ttt"
    assert choice["finish_reason"] == "length" and answer["usage"] == {"completion_tokens": 3}
    assert d.received[0]["stream"] is True  # D always streams, so a cut answer shows


def test_a_stream_cut_before_done_is_a_failure_naming_the_transfer(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    d.cut_stream = True
    proxy = proxy_for("read", [p.url], [d.url])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 502 and "without [DONE]" in reply.json()["error"]["message"]
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", timeout=30, json={"prompt": [1], "stream": True}
    ) as streamed:
        tid = streamed.headers["x-transfer-id"]
        events = [
            json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")
        ]
    assert (
        events[-1]["error"]["transfer_id"] == tid
        and "without [DONE]" in events[-1]["error"]["message"]
    )
    assert httpx.get(f"{proxy.url}/health").json()["counts"]["failed"] == 2


def test_a_token_whose_text_is_error_is_not_an_error(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.text = d.text = "error"
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    assert post(proxy, {"prompt": [1]}).status_code == 200
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", timeout=30, json={"prompt": [1], "stream": True}
    ) as reply:
        lines = list(reply.iter_lines())
    assert "data: [DONE]" in lines
    assert httpx.get(f"{proxy.url}/health").json()["counts"]["failed"] == 0


def test_a_silent_instance_is_a_504_naming_the_transfer_and_is_not_marked_down(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.delay_s = 5.0
    proxy = proxy_for("read", [p.url], [d.url], request_timeout_s=1.0)
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 504 and reply.json()["error"]["type"] == "timeout"
    assert reply.headers["x-transfer-id"] == reply.json()["error"]["transfer_id"]
    assert httpx.get(f"{proxy.url}/health").json()["prefill"][0]["up"]  # slow is not dead


def test_a_client_that_leaves_ends_ds_request(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    d.delay_s = 20.0
    proxy = proxy_for("read", [p.url], [d.url])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.url}/v1/completions", json={"prompt": [1]}, timeout=1.0)
    for _ in range(100):
        if d.disconnected:
            break
        time.sleep(0.05)
    assert d.disconnected == 1
    assert httpx.get(f"{proxy.url}/health").json()["counts"]["cancelled"] == 1


def test_a_decode_that_is_down_is_skipped_with_a_new_transfer(fakes, proxy_for):
    p, alive = fakes("P"), fakes("D1")
    dead = f"http://127.0.0.1:{free_port()},kv=127.0.0.1:1:2"
    proxy = proxy_for("write", [p.spec()], [dead, alive.spec()])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 200 and len(alive.received) == 1
    assert alive.received[0]["kv_transfer_params"]["transfer_id"] == reply.headers["x-transfer-id"]
    assert [i["up"] for i in httpx.get(f"{proxy.url}/health").json()["decode"]] == [False, True]


@pytest.mark.parametrize(
    "body, expected",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"max_tokens": 3}', "got nothing"),
        (b'{"prompt": [1], "stream": "yes"}', "'stream' must be true or false"),
        (b'{"prompt": [1], "n": 2}', "'n' must be 1"),
        (b'{"prompt": [1], "kv_transfer_params": {"do_remote_prefill": true}}', "set by the proxy"),
        (b'{"prompt": ["a", "b"]}', "one prompt per request"),
        (b'{"prompt": [[1, 2], [3]]}', "one prompt per request"),
        (b'{"prompt": null}', "'prompt' must be"),
        (b'{"prompt": [1, true]}', "one prompt per request"),
        (b'{"prompt": [1], "n": true}', "'n' must be 1"),
        (b'{"prompt": [1], "n": 1.0}', "'n' must be 1"),
        (b'{"prompt": [1], "best_of": 3}', "best_of"),
        (b'{"prompt": [1], "max_tokens": 0}', "'max_tokens'"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not JSON the proxy accepts"),
        # numbers JSON can write but P and D cannot be sent: the field is named
        (b'{"prompt": [1], "temperature": 1e999}', "'temperature' must be a finite number"),
        (b'{"prompt": [1], "temperature": NaN}', "'temperature' must be a finite number"),
        (b'{"prompt": [1], "temperature": Infinity}', "'temperature' must be a finite number"),
        (b'{"prompt": [1], "top_p": -Infinity}', "'top_p' must be a finite number"),
        (
            b'{"prompt": [1], "logit_bias": {"50": -1e400}}',
            "'logit_bias.\"50\"' must be a finite number",
        ),
        (
            b'{"prompt": [1], "extra": {"deep": [[0.5, NaN]]}}',
            "'extra.deep[0][1]' must be a finite number",
        ),
        # lone surrogates: valid JSON escapes, not valid Unicode
        (b'{"prompt": "hello \\ud800"}', "'prompt' is not valid Unicode"),
        (b'{"prompt": [1], "stop": ["ok", "\\udfff"]}', "'stop[1]' is not valid Unicode"),
        (b'{"prompt": [1], "\\ud800": 1}', "a key of 'the request' is not valid Unicode"),
        # ill-typed fields, some of which only D would see
        (b'{"prompt": [1], "temperature": "hot"}', "'temperature' must be a number"),
        (b'{"prompt": [1], "temperature": true}', "'temperature' must be a number"),
        (b'{"prompt": [1], "stream_options": 3}', "'stream_options' must be an object"),
        (b'{"prompt": [1], "min_tokens": 1.5}', "'min_tokens' must be an integer"),
        (b'{"prompt": [1], "stop": [1]}', "'stop' must be a string or a list of strings"),
        (b'{"prompt": [1], "logit_bias": {"5": "x"}}', "'logit_bias' must be an object of numbers"),
        (b'{"prompt": [1], "seed": "1"}', "'seed' must be an integer"),
        (
            b'{"prompt": [1], "n": [' + b"1," * 100_000 + b"1]}",
            "'n' must be 1 behind a P/D proxy, got [1, 1",
        ),
    ],
    ids=lambda value: value[:60].decode(errors="replace") if isinstance(value, bytes) else None,
)
def test_hostile_requests_are_refused_with_the_field_named(fakes, proxy_for, body, expected):
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("read", [p.url], [d.url])
    reply = httpx.post(
        f"{proxy.url}/v1/completions",
        content=body,
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert expected in error["message"] and error["type"] == "invalid_request_error"
    assert len(error["message"]) < 400  # a value is shown, not echoed whole
    assert p.received == [] and d.received == []
    assert post(proxy, {"prompt": [1]}).status_code == 200  # and it still serves


def test_an_oversized_body_is_refused_before_it_is_read_whole(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("read", [p.url], [d.url], max_body_bytes=1 << 16)
    reply = httpx.post(
        f"{proxy.url}/v1/completions",
        timeout=30,
        content=json.dumps({"prompt": list(range(100_000))}).encode(),
    )
    assert reply.status_code == 413 and "bytes" in reply.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while read
        yield b'{"prompt": ['
        for _ in range(200):
            yield b"1," * 1000
        yield b"1]}"

    reply = httpx.post(f"{proxy.url}/v1/completions", content=chunks(), timeout=30)
    assert reply.status_code == 413
    assert p.received == [] and d.received == []


def test_a_flood_of_junk_leaves_the_proxy_serving(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("read", [p.url], [d.url])
    with httpx.Client(timeout=10) as client:
        for i in range(200):
            junk = bytes((i * 37 + k) % 256 for k in range(64))
            assert client.post(f"{proxy.url}/v1/completions", content=junk).status_code == 400
    assert post(proxy, {"prompt": [1]}).status_code == 200


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("127.0.0.1:8000", "http:// URL"),
        ("http://", "http:// URL"),
        ("http://x,kv=:1:2", "a host and ports"),
        ("http://x,kv=h:0:1", "ports in 1-65535"),
        ("http://x,kv=h:a:1", "ports in 1-65535"),
        ("http://x,kv=h:1", "HOST:NOTIFY_PORT:HANDSHAKE_PORT"),
        ("http://x,tp=0", "'tp=0'.*tp=N"),
        ("http://x,tp=two", "'tp=two'"),
        ("http://x,tp=-1", "'tp=-1'"),
        ("http://x,tp=99999", "N in 1-4096"),
        ("http://x,kv=h:1:2,kv=h:3:4", "each at most once"),
        ("http://x,weights=1", "'weights=1'"),
        ("http://x,", "unexpected ''"),
    ],
)
def test_bad_instance_specs_are_named(spec, expected):
    with pytest.raises(ProxyConfigError, match=expected):
        Instance.parse("P0", spec)


def test_an_instance_spec_takes_kv_and_tp_in_either_order():
    for spec in ("http://h:8000,kv=h:7001:7002,tp=2", "http://h:8000,tp=2,kv=h:7001:7002"):
        instance = Instance.parse("P0", spec)
        assert (instance.kv_host, instance.handshake_port, instance.tp_size) == ("h", 7002, 2)
    assert Instance.parse("P0", "http://h:8000").tp_size == 1


def test_an_ipv6_connector_host_is_understood():
    instance = Instance.parse("P0", "http://[::1]:8000,kv=[::1]:7001:7002")
    assert (instance.kv_host, instance.notify_port, instance.handshake_port) == ("::1", 7001, 7002)


def test_write_mode_needs_connector_addresses():
    with pytest.raises(ProxyConfigError, match="WRITE mode needs where its connector listens"):
        ProxyConfig(
            "write", [Instance.parse("P0", "http://a")], [Instance.parse("D0", "http://b,kv=h:1:2")]
        )
    with pytest.raises(ProxyConfigError, match="mode"):
        ProxyConfig("push", [Instance.parse("P0", "http://a")], [Instance.parse("D0", "http://b")])
    with pytest.raises(ProxyConfigError, match="request_timeout_s"):
        ProxyConfig(
            "read",
            [Instance.parse("P0", "http://a")],
            [Instance.parse("D0", "http://b")],
            request_timeout_s=float("nan"),
        )
