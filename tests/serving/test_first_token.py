"""READ mode's early first token, against stand-in servers: P's token reaches the client before D answers, D
gets the prompt plus that token, and the client's answer is one sequence with its usage as one instance's.

Requests the split cannot serve exactly, P answers it cannot continue from and hostile P answers all take the
plain READ way; a D lost after the first token was sent is replaced, or ends the stream with an error event."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fake_vllm import free_port, post

PROMPT = [5, 6, 7, 8]


def stream(proxy, body):
    """The client's events, the first one read before the rest is asked for; and the reply's headers."""
    with httpx.stream(
        "POST", f"{proxy.url}/v1/completions", json=dict(body, stream=True), timeout=30
    ) as reply:
        assert reply.status_code == 200
        lines = (line for line in reply.iter_lines() if line.startswith("data: "))
        first = next(lines)
        yield json.loads(first[6:])
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    yield [json.loads(line[6:]) for line in rest[:-1]]


def test_ps_token_reaches_the_client_before_d_answers(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D", tokens=[10, 11, 12])
    d.delay_s = 1.0
    proxy = proxy_for("read", [p.url], [d.url])
    events = stream(
        proxy, {"model": "m", "prompt": PROMPT, "max_tokens": 4, "return_token_ids": True}
    )
    first = next(events)
    assert d.answered == 0, "the first token waited for D"
    assert first["choices"][0]["token_ids"] == [9]
    assert first["choices"][0]["prompt_token_ids"] == PROMPT
    rest = next(events)
    tokens = [t for e in rest for c in e["choices"] for t in c.get("token_ids", ())]
    assert tokens == [10, 11, 12]
    usage = [e["usage"] for e in rest if e.get("usage")]
    assert usage == [{"prompt_tokens": 4, "completion_tokens": 4}]  # as one instance counts
    assert all("prompt_token_ids" not in c for e in rest for c in e["choices"])


def test_d_gets_the_prompt_plus_ps_token_and_ps_kv(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D", tokens=[10, 11])
    p.reply_params = {"do_remote_prefill": True, "remote_block_ids": [3], "remote_prompt_tokens": 4}
    proxy = proxy_for("read", [p.url], [d.url])
    answer = post(proxy, {"prompt": PROMPT, "max_tokens": 3, "min_tokens": 2, "temperature": 0})
    assert answer.status_code == 200
    (to_p,), (to_d,) = p.received, d.received
    assert to_p["return_token_ids"] is True and to_p["max_tokens"] == 1
    assert to_d["prompt"] == PROMPT + [9]
    assert (to_d["max_tokens"], to_d["min_tokens"]) == (2, 1)
    assert to_d["kv_transfer_params"] == p.reply_params
    assert answer.json()["choices"][0]["text"] == "ttt"  # P's "t", then D's two
    assert answer.json()["choices"][0]["token_ids"] == [9, 10, 11]


def test_a_whole_answer_joins_ps_token_and_ds(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D", tokens=[10, 11])
    p.text, d.text = "He", "llo"
    proxy = proxy_for("read", [p.url], [d.url])
    answer = post(proxy, {"prompt": PROMPT, "max_tokens": 3, "return_token_ids": True}).json()
    (choice,) = answer["choices"]
    assert choice["text"] == "Hellollo" and choice["token_ids"] == [9, 10, 11]
    assert choice["prompt_token_ids"] == PROMPT
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 3}


@pytest.mark.parametrize(
    "change",
    [
        {"stop": ["x"]},
        {"n": 2},
        {"logprobs": 1},
        {"echo": True},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 1},
        {"response_format": {"type": "json_object"}},
        {"max_tokens": 1},
        {"prompt": ["a", "b"]},
        {"prompt": []},
        {"suffix": "!"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_request_the_split_cannot_serve_exactly_goes_the_plain_way(fakes, proxy_for, change):
    p, d = fakes("P", tokens=[9]), fakes("D")
    proxy = proxy_for("read", [p.url], [d.url])
    body = dict({"prompt": PROMPT, "max_tokens": 4}, **change)
    reply = post(proxy, body)
    if reply.status_code == 400:  # refused outright (no P/D split serves it): nobody was asked
        assert p.received == [] and d.received == []
        return
    assert "return_token_ids" not in p.received[0]
    assert d.received[0]["prompt"] == body["prompt"]


@pytest.mark.parametrize(
    "answer",
    [
        {"finish_reason": "stop"},  # P's first token ended it: D makes the same answer
        {"tokens": [9, 10]},
        {"tokens": []},
        {"text": None},
    ],
    ids=["stopped", "two_tokens", "no_token", "no_text"],
)
def test_an_answer_p_cannot_be_continued_from_goes_the_plain_way(fakes, proxy_for, answer):
    p, d = fakes("P", tokens=answer.get("tokens", [9])), fakes("D", tokens=[1, 2])
    p.finish_reason = answer.get("finish_reason", "length")
    if "text" in answer:
        p.text = answer["text"]
    proxy = proxy_for("read", [p.url], [d.url])
    reply = post(proxy, {"prompt": PROMPT, "max_tokens": 4})
    assert reply.status_code == 200
    assert d.received[0]["prompt"] == PROMPT and d.received[0]["max_tokens"] == 4


def test_turned_off_the_client_waits_for_d_as_before(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D")
    proxy = proxy_for("read", [p.url], [d.url], first_token_from_prefill=False)
    post(proxy, {"prompt": PROMPT, "max_tokens": 4})
    assert "return_token_ids" not in p.received[0] and d.received[0]["prompt"] == PROMPT


def test_a_d_that_never_saw_the_request_is_replaced_with_the_same_kv(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D1", tokens=[10])
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = proxy_for("read", [p.url], [dead, d.url])
    events = stream(proxy, {"prompt": PROMPT, "max_tokens": 2})
    assert next(events)["choices"][0]["text"] == "t"
    rest = next(events)
    assert [c["token_ids"] for e in rest for c in e["choices"]] == [[10]]
    assert d.received[0]["kv_transfer_params"] == p.reply_params
    health = httpx.get(f"{proxy.url}/health").json()
    assert [i["up"] for i in health["decode"]] == [False, True]


def test_no_d_left_after_the_first_token_ends_the_stream_with_an_error_naming_the_transfer(
    fakes, proxy_for
):
    p = fakes("P", tokens=[9])
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = proxy_for("read", [p.url], [dead])
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "stream": True},
        timeout=30,
    ) as reply:
        tid = reply.headers["x-transfer-id"]
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    first, last = json.loads(lines[0][6:]), json.loads(lines[-1][6:])
    assert first["choices"][0]["text"] == "t"
    assert last["error"]["transfer_id"] == tid and "no decode instance" in last["error"]["message"]
    assert httpx.get(f"{proxy.url}/health").json()["counts"]["failed"] == 1


def test_a_client_leaving_after_the_first_token_closes_ds_request(fakes, proxy_for):
    p, d = fakes("P", tokens=[9]), fakes("D")
    d.delay_s = 5.0
    proxy = proxy_for("read", [p.url], [d.url])
    with httpx.stream(
        "POST",
        f"{proxy.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "stream": True},
        timeout=30,
    ) as reply:
        lines = reply.iter_lines()  # kept: a closed line iterator closes the response
        assert next(lines).startswith("data: ")
        assert wait_for(lambda: d.received), "D was never asked"
    assert wait_for(lambda: d.disconnected), "D's request stayed open after the client left"
    assert d.answered == 0
    assert wait_for(lambda: httpx.get(f"{proxy.url}/health").json()["counts"]["cancelled"] == 1)


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("flag, early", [([], True), (["--no-first-token-from-prefill"], False)])
def test_the_proxy_command_sends_the_first_token_early_unless_told_not_to(flag, early):
    from moriio_fsm.cli import build_parser
    from moriio_fsm.cli.proxy import proxy_settings

    args = build_parser().parse_args(
        ["proxy", "--mode", "read", "--prefill", "http://p:1", "--decode", "http://d:2", *flag]
    )
    assert proxy_settings(args)["first_token_from_prefill"] is early
