"""Control-message faults: seeded losses, duplicates and delays, bounded, closed cleanly."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from moriio_fsm.vllm.message_faults import MAX_DELAYED, MessageFaults, wants_message_faults
from moriio_fsm.vllm.settings import ConnectorConfigError, ConnectorSettings


def message(i):
    return SimpleNamespace(kind="write_done", transfer_id=f"tx-{i}")


def run(faults, count=2000):
    sent, lock = [], threading.Lock()

    def send(destination, msg):
        with lock:
            sent.append(msg.transfer_id)

    wrapper = MessageFaults(send, faults)
    try:
        for i in range(count):
            wrapper.send(("127.0.0.1", 1), message(i))
        deadline = time.monotonic() + 5
        expected = count - wrapper.counts["lost"] + wrapper.counts["duplicated"]
        while len(sent) < expected and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        wrapper.close()
    return wrapper.counts, sent


def test_rates_lose_duplicate_and_delay_about_as_asked_and_repeatably():
    faults = {
        "message_loss_rate": 0.1,
        "message_dup_rate": 0.1,
        "message_delay_rate": 0.1,
        "message_delay_s": 0.01,
        "seed": 3,
    }
    counts, sent = run(faults)
    assert 100 < counts["lost"] < 320 and 100 < counts["duplicated"] < 320
    assert 100 < counts["delayed"] < 320
    assert len(sent) == 2000 - counts["lost"] + counts["duplicated"]  # every kept one arrives
    again, sent_again = run(faults)
    assert again == counts and sorted(sent_again) == sorted(sent)  # seeded


def test_no_rates_means_no_wrapper_and_delays_are_bounded():
    assert not wants_message_faults({"fail_rate": 0.5})
    assert wants_message_faults({"message_loss_rate": 0.01})
    counts, sent = run({"message_delay_rate": 1.0, "message_delay_s": 30.0}, count=MAX_DELAYED + 50)
    assert counts["delayed"] == MAX_DELAYED  # the rest went at once, nothing piled up
    assert len(sent) >= 50


def test_a_delayed_send_that_raises_does_not_kill_the_timer_thread():
    calls = []

    def send(destination, msg):
        calls.append(msg.transfer_id)
        if msg.transfer_id == "tx-0":
            raise RuntimeError("peer gone")

    wrapper = MessageFaults(send, {"message_delay_rate": 1.0, "message_delay_s": 0.01})
    try:
        wrapper.send(None, message(0))
        wrapper.send(None, message(1))
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        wrapper.close()
    assert sorted(calls) == ["tx-0", "tx-1"]


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.1", float("nan"), True])
def test_bad_rates_are_named(value):
    with pytest.raises(ConnectorConfigError, match="message_loss_rate"):
        ConnectorSettings.from_extra_config({"fault_injection": {"message_loss_rate": value}})


def test_lose_first_loses_exactly_the_first_message_of_that_kind():
    sent = []
    wrapper = MessageFaults(lambda to, msg: sent.append(msg), {"message_lose_first": "release"})
    try:
        release = [SimpleNamespace(kind="release", transfer_id=f"r-{i}") for i in range(3)]
        wrapper.send(("127.0.0.1", 1), message(0))  # another kind goes through
        for msg in release:
            wrapper.send(("127.0.0.1", 1), msg)
    finally:
        wrapper.close()
    assert [m.transfer_id for m in sent] == ["tx-0", "r-1", "r-2"]
    assert wrapper.counts["lost"] == 1
    assert wants_message_faults({"message_lose_first": "release"})


@pytest.mark.parametrize("value", ["write-done", "", 3, None, ["write_done"]])
def test_lose_first_names_a_known_message_kind(value):
    with pytest.raises(ConnectorConfigError, match="message_lose_first.*write_done"):
        ConnectorSettings.from_extra_config({"fault_injection": {"message_lose_first": value}})
