"""The P/D proxy against stand-in servers: what P and D are sent in each mode, streaming,
round robin, instances that are down, failed transfers named in the error, hostile input."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from moriio_fsm.serving.proxy import Instance, ProxyConfig, ProxyConfigError, ProxyServer

from fake_vllm import FakeVllm, free_port


@pytest.fixture
def fakes():
    made: list[FakeVllm] = []

    def make(name, **kw):
        made.append(FakeVllm(name, **kw))
        return made[-1]
    yield make
    for fake in made:
        fake.stop()


@pytest.fixture
def proxy_for():
    started: list[ProxyServer] = []

    def start(mode, prefills, decodes, **kw):
        config = ProxyConfig(mode, [Instance.parse(f"P{i}", s) for i, s in enumerate(prefills)],
                             [Instance.parse(f"D{i}", s) for i, s in enumerate(decodes)], **kw)
        started.append(ProxyServer(config, free_port()).start())
        return started[-1]
    yield start
    for server in started:
        server.stop()


def post(proxy, body, **kw):
    return httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30, **kw)


def test_write_mode_sends_both_parts_with_each_others_address(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D", tokens=[5, 6, 7])
    proxy = proxy_for("write", [p.spec(7101, 7102)], [d.spec(7201, 7202)])
    reply = post(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["token_ids"] == [5, 6, 7]
    tid = reply.headers["x-transfer-id"]
    (to_p,), (to_d,) = p.received, d.received
    assert to_p["max_tokens"] == 1 and to_p["stream"] is True     # D goes once P's stream opened
    assert to_p["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid,
                                          "remote_host": "127.0.0.1", "remote_notify_port": 7201,
                                          "remote_handshake_port": 7202}
    assert to_d["max_tokens"] == 8 and to_d["prompt"] == [1, 2, 3]
    assert to_d["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": tid,
                                          "remote_host": "127.0.0.1", "remote_notify_port": 7101,
                                          "remote_handshake_port": 7102}


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
    with httpx.stream("POST", f"{proxy.url}/v1/completions", timeout=30,
                      json={"prompt": [1], "max_tokens": 3, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(l[6:])["choices"][0]["token_ids"][0] for l in lines[:-1]] == [11, 12, 13]


def test_round_robin_over_instances(fakes, proxy_for):
    ps, ds = [fakes("P0"), fakes("P1")], [fakes("D0"), fakes("D1")]
    proxy = proxy_for("read", [p.url for p in ps], [d.url for d in ds])
    for _ in range(4):
        assert post(proxy, {"prompt": [1]}).status_code == 200
    assert [len(x.received) for x in ps + ds] == [2, 2, 2, 2]


def test_a_prefill_that_is_down_is_reported_and_skipped(fakes, proxy_for):
    alive, d = fakes("P1"), fakes("D")
    dead = f"http://127.0.0.1:{free_port()}"            # nothing listens there
    proxy = proxy_for("write", [f"{dead},kv=127.0.0.1:1:2", alive.spec()], [d.spec()])
    for _ in range(3):
        reply = post(proxy, {"prompt": [1]})
        assert reply.status_code == 200
    health = httpx.get(f"{proxy.url}/health").json()
    assert [i["up"] for i in health["prefill"]] == [False, True]
    assert "ConnectError" in health["prefill"][0]["last_error"]
    assert health["counts"]["retried"] == 1              # skipped once it was known down
    assert len(alive.received) == 3


def test_no_prefill_left_is_a_503_naming_each_instance(fakes, proxy_for):
    d = fakes("D")
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = proxy_for("read", [dead], [d.url])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 503
    message = reply.json()["error"]["message"]
    assert "no prefill instance is available" in message and dead in message
    assert d.received == []                               # D was never asked for a lost cause
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
    with httpx.stream("POST", f"{proxy.url}/v1/completions", timeout=30,
                      json={"prompt": [1], "stream": True}) as reply:
        tid = reply.headers["x-transfer-id"]
        events = [json.loads(l[6:]) for l in reply.iter_lines() if l.startswith("data: {")]
    assert events[0]["error"]["transfer_id"] == tid
    assert tid in events[0]["error"]["message"]


def test_read_mode_prefill_error_fails_before_d_is_asked(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.status = 400
    proxy = proxy_for("read", [p.url], [d.url])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 502
    assert "prefill P0" in reply.json()["error"]["message"] and "400" in reply.json()["error"]["message"]
    assert d.received == []


def test_write_mode_d_is_not_asked_when_p_refuses(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.status = 500
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 502 and "prefill P0" in reply.json()["error"]["message"]
    assert d.received == []          # D holds no blocks for a transfer P never started


def test_write_mode_an_unreachable_p_is_retried_before_d_is_asked(fakes, proxy_for):
    alive, d = fakes("P1"), fakes("D")
    dead = f"http://127.0.0.1:{free_port()},kv=127.0.0.1:1:2"
    proxy = proxy_for("write", [dead, alive.spec(7301, 7302)], [d.spec()])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 200
    (to_d,) = d.received             # one D request, naming the P that took the transfer
    assert to_d["kv_transfer_params"]["remote_notify_port"] == 7301


def test_write_mode_p_failing_mid_stream_ends_ds_wait_at_once(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    p.error_event = True             # P accepted, then its stream carries an error
    d.delay_s = 20.0                 # D would wait for writes that never come
    proxy = proxy_for("write", [p.spec()], [d.spec()])
    reply = post(proxy, {"prompt": [1]})
    assert reply.status_code == 502 and "prefill P0" in reply.json()["error"]["message"]
    # D was not asked yet, or its request was closed (so vLLM would abort it)
    for _ in range(100):
        if d.disconnected == len(d.received):
            break
        time.sleep(0.05)
    assert d.disconnected == len(d.received) <= 1


@pytest.mark.parametrize("body, expected", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"max_tokens": 3}', "no 'prompt'"),
    (b'{"prompt": [1], "stream": "yes"}', "'stream' must be true or false"),
    (b'{"prompt": [1], "n": 2}', "'n' must be 1"),
    (b'{"prompt": [1], "kv_transfer_params": {"do_remote_prefill": true}}', "set by the proxy"),
])
def test_hostile_requests_are_refused_with_the_field_named(fakes, proxy_for, body, expected):
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("read", [p.url], [d.url])
    reply = httpx.post(f"{proxy.url}/v1/completions", content=body, timeout=10,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert expected in reply.json()["error"]["message"]
    assert p.received == [] and d.received == []
    assert post(proxy, {"prompt": [1]}).status_code == 200       # and it still serves


def test_a_flood_of_junk_leaves_the_proxy_serving(fakes, proxy_for):
    p, d = fakes("P"), fakes("D")
    proxy = proxy_for("read", [p.url], [d.url])
    with httpx.Client(timeout=10) as client:
        for i in range(200):
            junk = bytes((i * 37 + k) % 256 for k in range(64))
            assert client.post(f"{proxy.url}/v1/completions", content=junk).status_code == 400
    assert post(proxy, {"prompt": [1]}).status_code == 200


@pytest.mark.parametrize("spec, expected", [
    ("127.0.0.1:8000", "http:// URL"),
    ("http://x,kv=127.0.0.1:7000", "HOST:NOTIFY_PORT:HANDSHAKE_PORT"),
    ("http://x,kv=h:0:1", "ports in 1-65535"),
    ("http://x,kv=h:a:1", "ports in 1-65535"),
])
def test_bad_instance_specs_are_named(spec, expected):
    with pytest.raises(ProxyConfigError, match=expected):
        Instance.parse("P0", spec)


def test_write_mode_needs_connector_addresses():
    with pytest.raises(ProxyConfigError, match="WRITE mode needs where its connector listens"):
        ProxyConfig("write", [Instance.parse("P0", "http://a")], [Instance.parse("D0", "http://b,kv=h:1:2")])
    with pytest.raises(ProxyConfigError, match="mode"):
        ProxyConfig("push", [Instance.parse("P0", "http://a")], [Instance.parse("D0", "http://b")])
    with pytest.raises(ProxyConfigError, match="request_timeout_s"):
        ProxyConfig("read", [Instance.parse("P0", "http://a")], [Instance.parse("D0", "http://b")],
                    request_timeout_s=float("nan"))
