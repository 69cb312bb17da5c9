"""Lets the serving tests import their stand-in server (``fake_vllm``) by name, and makes stand-in servers and
proxies over them that are stopped after each test."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402 (after the path is set)
from fake_vllm import FakeVllm, free_port  # noqa: E402

from moriio_fsm.serving.instances import Instance, ProxyConfig  # noqa: E402
from moriio_fsm.serving.proxy_app import ProxyServer  # noqa: E402


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
        config = ProxyConfig(
            mode,
            [Instance.parse(f"P{i}", s) for i, s in enumerate(prefills)],
            [Instance.parse(f"D{i}", s) for i, s in enumerate(decodes)],
            **kw,
        )
        started.append(ProxyServer(config, free_port()).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()
