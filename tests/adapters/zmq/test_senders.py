"""The senders a transfer is bound to: addresses as given, names looked up rarely and never on
the caller's thread, keys in hex."""

from __future__ import annotations

import threading
import time

from moriio_fsm.adapters.zmq.senders import AddressCache, expected_senders, sender_name


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def settled(cache, host, timeout_s=5.0):
    """What ``expected_senders`` gives once the background lookup of ``host`` answered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = expected_senders(host, None, cache)
        if found is not None:
            return found
        time.sleep(0.01)
    raise AssertionError(f"{host} was never resolved")


def test_an_address_is_its_own_sender_in_canonical_form_without_any_lookup():
    def lookup(name):
        raise AssertionError("an address needs no lookup")

    cache = AddressCache(lookup=lookup)
    assert expected_senders("198.18.0.2", None, cache) == "198.18.0.2"
    assert expected_senders("[2001:DB8::0:2]", None, cache) == "2001:db8::2"
    assert expected_senders("::ffff:198.18.0.3", None, cache) == "198.18.0.3"


def test_a_slow_lookup_never_holds_up_the_caller():
    release = threading.Event()

    def slow(name):
        release.wait(10)
        return ("198.18.0.7",)

    cache = AddressCache(lookup=slow)
    started = time.monotonic()
    assert expected_senders("decode-0", None, cache) is None  # not known yet: no wait
    assert time.monotonic() - started < 1.0
    release.set()
    assert settled(cache, "decode-0") == "198.18.0.7"


def test_a_name_is_looked_up_once_per_ttl_and_binds_every_address_it_has():
    asked, clock = [], Clock()

    def lookup(name):
        asked.append(name)
        return ("198.18.0.2", "2001:db8::2")

    cache = AddressCache(ttl_s=60.0, lookup=lookup, clock=clock)
    assert settled(cache, "Decode-0.") == "198.18.0.2,2001:db8::2"
    for _ in range(100):
        assert expected_senders("decode-0", None, cache) == "198.18.0.2,2001:db8::2"
    assert asked == ["decode-0"]
    clock.now = 61.0
    # Past its time the answer still serves while one refresh runs in the background.
    assert expected_senders("decode-0", None, cache) == "198.18.0.2,2001:db8::2"
    deadline = time.monotonic() + 5
    while len(asked) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert asked == ["decode-0", "decode-0"]


def test_a_name_that_does_not_resolve_or_a_junk_host_binds_to_no_sender():
    def lookup(name):
        raise OSError("no such host")

    cache = AddressCache(lookup=lookup)
    assert settled(cache, "nowhere.invalid") == "-"
    assert expected_senders("bad host!", None, cache) == "-"
    assert expected_senders("127.1", None, cache) == "-"  # an ambiguous numeric form


def test_the_cache_of_names_is_bounded_whatever_the_requests_name():
    cache = AddressCache(max_names=16, lookup=lambda name: ("198.18.0.9",))
    for index in range(1000):
        cache.addresses(f"host-{index}")
    assert len(cache._answers) <= 16


def test_a_sender_with_a_key_is_host_slash_key():
    assert sender_name("198.18.0.2", "ab" * 32) == "198.18.0.2/" + "ab" * 32
    assert sender_name("198.18.0.2") == "198.18.0.2"


def test_an_ipv6_answer_a_python_without_ipv6_cannot_read_is_left_out(monkeypatch):
    import socket

    # Built without IPv6, Python gives an AF_INET6 answer's address as (int, bytes).
    answers = [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (10, b"\x00" * 16)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("198.18.0.4", 0)),
    ]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answers)
    assert AddressCache().addresses("decode-0") == ("198.18.0.4",)
