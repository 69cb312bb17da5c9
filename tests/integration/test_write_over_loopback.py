"""The runtime, layout plans, loopback engine, poller and ZeroMQ transport together."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moriio_fsm.adapters.zmq import WriteDone, WriteFailed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "write_over_loopback.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("write_over_loopback", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bytes_land_in_d_and_d_hears_write_done(example):
    outcome = example.run()
    assert isinstance(outcome["verdict"], WriteDone)
    assert outcome["verdict"].transfer_id == "tx-example-1"
    assert outcome["landed"] is True
    assert outcome["freed"] is True and outcome["final_state"] == "released"


def test_a_failed_layer_write_reaches_d_as_write_failed(example):
    outcome = example.run(fail_layer=2)
    assert isinstance(outcome["verdict"], WriteFailed)
    assert outcome["freed"] is True and outcome["final_state"] == "failed"
    assert any(line.startswith("layer_write_failed") for line in outcome["log"])


def test_a_write_that_never_reports_back_is_torn_down_and_d_is_told(example):
    outcome = example.run(stall_layer=1)
    assert isinstance(outcome["verdict"], WriteFailed)
    assert outcome["final_state"] == "failed" and outcome["freed"] is True
    assert any(
        line.startswith("transfer_timeout") and "abandoning" in line for line in outcome["log"]
    )
    assert any(line.startswith("writes_abandoned") for line in outcome["log"])
