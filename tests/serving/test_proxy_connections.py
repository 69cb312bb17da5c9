"""The proxy's connections under clients that misbehave, over real sockets on 127.0.0.1:
clients that leave mid-body, bodies and heads that never finish, more connections than the
cap. Each is counted in ``GET /health``, none leaves a traceback, and normal requests are
served meanwhile. Every wait is bounded by a socket timeout or a deadline.
"""

from __future__ import annotations

import logging
import socket
import time
from contextlib import contextmanager

import httpx
import pytest
from fake_vllm import FakeVllm, free_port

from moriio_fsm.cli import main as cli_main
from moriio_fsm.serving.instances import Instance, ProxyConfig
from moriio_fsm.serving.proxy_app import ProxyServer

WAIT_S = 20.0  # a hang bound, not a speed claim


@pytest.fixture
def served():
    """A read-mode proxy (settings as given) in front of a fake P and D."""
    made: list = []

    def start(**settings):
        p, d = FakeVllm("P"), FakeVllm("D")
        made.extend([p, d])
        config = ProxyConfig(
            "read", [Instance.parse("P0", p.url)], [Instance.parse("D0", d.url)], **settings
        )
        made.append(ProxyServer(config, free_port()).start())
        return made[-1], p, d

    yield start
    for server in reversed(made):
        server.stop()


@pytest.fixture
def sockets():
    """Raw client sockets, all closed at the end."""
    opened: list[socket.socket] = []

    def connect(proxy) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S)
        opened.append(sock)
        return sock

    yield connect
    for sock in opened:
        sock.close()


def head(length: int) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % length
    )


def start_slow_body(sock: socket.socket) -> socket.socket:
    """A request whose head is whole and whose body has barely begun."""
    sock.sendall(head(1000) + b'{"prompt": [')
    return sock


def until_closed(sock: socket.socket) -> bytes:
    """Everything the proxy sends until it closes the connection (a timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def health(proxy) -> dict:
    reply = httpx.get(f"{proxy.url}/health", timeout=10)
    return reply.json()


def wait_for(check, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {WAIT_S}s: {what}")


def normal(url: str, client=httpx) -> httpx.Response:
    return client.post(
        f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 3}, timeout=WAIT_S
    )


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextmanager
def logs_of_the_server():
    """What the server logs meanwhile: uvicorn's loggers do not reach the root logger."""
    handler = Records()
    names = ("", "uvicorn", "uvicorn.error", "asyncio", "moriio_fsm")
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        yield handler.records
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)


def test_clients_that_leave_mid_body_are_counted_and_leave_no_traceback(served, sockets):
    proxy, p, d = served()
    with logs_of_the_server() as records:
        for _ in range(10):
            start_slow_body(sockets(proxy)).close()
        counts = wait_for(
            lambda: (c := health(proxy)["counts"]).get("left_mid_body") == 10 and c,
            "10 clients counted as gone mid-body",
        )
        assert normal(proxy.url).status_code == 200
    assert counts["cancelled"] == 10 and counts["failed"] == 0 and counts["rejected"] == 0
    assert len(p.received) == len(d.received) == 1  # the normal one: half a body never goes on
    loud = [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud][:3]


def test_slow_bodies_are_cut_after_the_body_timeout_and_others_are_served_meanwhile(
    served, sockets
):
    proxy, p, d = served(body_timeout_s=3.0)
    slow = [start_slow_body(sockets(proxy)) for _ in range(20)]
    assert normal(proxy.url).status_code == 200  # while the 20 still hold theirs
    for sock in slow:
        sock.sendall(b"1,")  # trickling does not buy time
    answers = [until_closed(sock) for sock in slow]
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 408 ") and b"body_timeout_s" in answer
    counts = health(proxy)["counts"]
    assert counts["body_timeouts"] == 20 and counts["rejected"] == 20
    assert len(p.received) == len(d.received) == 1  # the normal one only
    assert normal(proxy.url).status_code == 200


def test_a_head_that_never_ends_is_cut_but_a_long_answer_is_not(served, sockets):
    proxy, p, d = served(header_timeout_s=0.5)
    d.delay_s = 2.0  # the answer takes longer than a head may
    partial = sockets(proxy)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
    silent = sockets(proxy)  # sends nothing at all
    assert normal(proxy.url).status_code == 200
    assert until_closed(partial) == b"" and until_closed(silent) == b""
    wait_for(
        lambda: health(proxy)["connections"]["header_timeouts"] == 2, "two heads too slow counted"
    )
    with httpx.Client() as client:  # a keep-alive connection may go on after its answers
        assert [normal(proxy.url, client).status_code for _ in range(3)] == [200, 200, 200]


def test_connections_over_the_cap_are_refused_and_those_within_are_served(served, sockets):
    proxy, p, d = served(max_connections=3, header_timeout_s=60.0, body_timeout_s=60.0)
    with httpx.Client() as client:  # one keep-alive connection, opened first: 1 of 3
        assert client.get(f"{proxy.url}/health", timeout=WAIT_S).status_code == 200
        holders = [start_slow_body(sockets(proxy)) for _ in range(2)]
        wait_for(
            lambda: client.get(f"{proxy.url}/health").json()["connections"]["open"] == 3,
            "the two holders counted",
        )
        over = sockets(proxy)
        over.sendall(head(17) + b'{"prompt": [1]}  ')
        answer = until_closed(over)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"max_connections=3" in answer
        assert normal(proxy.url, client).status_code == 200  # within the cap: served
        assert client.get(f"{proxy.url}/health").json()["connections"]["refused"] == 1
        holders[0].close()
        wait_for(
            lambda: client.get(f"{proxy.url}/health").json()["connections"]["open"] == 2,
            "a holder's close counted",
        )
    assert normal(proxy.url).status_code == 200  # a new connection, now room
    assert len(d.received) == 2


@pytest.mark.parametrize(
    "option, value, named",
    [
        ("--max-connections", "0", "max_connections"),
        ("--body-timeout", "-1", "body_timeout_s"),
        ("--header-timeout", "nan", "header_timeout_s"),
    ],
)
def test_the_proxy_commands_limits_are_checked(option, value, named, capsys):
    code = cli_main(
        [
            "proxy",
            "--mode",
            "read",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
            option,
            value,
        ]
    )
    assert code == 2 and named in capsys.readouterr().err
