"""Peer trust policy and the rank-to-port rule, as pure functions: no sockets.

Rules: each refused host is checked for the reason given, each accepted one for its canonical form, and ports
for the base + dp_rank * tp_size + tp_rank rule without collisions.
"""

from __future__ import annotations

import pytest

from moriio_fsm.adapters.zmq import PeerPolicy, RankEndpoint, UntrustedPeerError, listener_port


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "::ffff:127.0.0.1", "localhost", "LocalHost."],
)
def test_only_loopback_is_trusted_by_default(host):
    assert PeerPolicy().is_trusted(host)


@pytest.mark.parametrize(
    "host,reason",
    [
        ("10.0.0.1", "only loopback"),
        ("169.254.169.254", "only loopback"),  # cloud metadata endpoint: classic SSRF target
        ("example.com", "not in the trusted peers"),
        ("127.1", "ambiguous numeric address"),
        ("2130706433", "ambiguous numeric address"),
        ("0x7f000001", "ambiguous numeric address"),
        ("0.0.0.0", "not a unicast address"),
        ("::", "not a unicast address"),
        ("", "empty host"),
        ("evil.com/../x", "not an IP address or a valid host name"),
        ("a b", "not an IP address or a valid host name"),
    ],
)
def test_refusals_say_why(host, reason):
    with pytest.raises(UntrustedPeerError) as caught:
        PeerPolicy().check(host)
    assert reason in str(caught.value)
    assert caught.value.host == host


def test_configured_names_addresses_and_ranges_are_canonicalised():
    policy = PeerPolicy(
        [
            "Decode-0.Cluster.Local.",
            "10.1.0.0/16",
            "fd00:0:0:0::/64",
            "192.168.5.7",
            "::ffff:10.9.0.0/112",
        ]
    )
    assert policy.check("decode-0.cluster.local") == "decode-0.cluster.local"
    assert policy.check("DECODE-0.cluster.local.") == "decode-0.cluster.local"
    assert policy.check("10.1.200.3") == "10.1.200.3"
    assert policy.check("::ffff:10.1.2.3") == "10.1.2.3"
    assert policy.check("[fd00::0:1]") == "fd00::1"
    assert policy.check("192.168.5.7") == "192.168.5.7"
    assert policy.check("10.9.3.4") == "10.9.3.4"
    for refused in ("10.2.0.1", "fd01::1", "192.168.5.8", "decode-1.cluster.local", "127.0.0.1"):
        assert not policy.is_trusted(refused), refused


def test_names_are_not_resolved_to_match_ranges():
    # "localhost" resolves to loopback, but a range only matches literal addresses.
    assert not PeerPolicy(["127.0.0.0/8"]).is_trusted("localhost")


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "not a host!", "fe80::/200", "127.1"])
def test_bad_configuration_names_the_entry(entry):
    with pytest.raises(ValueError, match="trusted peer"):
        PeerPolicy([entry])


def test_listener_port_separates_every_rank():
    ports = {
        listener_port(6000, dp_rank=dp, tp_rank=tp, tp_size=4) for dp in range(3) for tp in range(4)
    }
    assert len(ports) == 12
    # The two ranks upstream's two-argument form sends to the same port:
    assert listener_port(6000, dp_rank=0, tp_rank=1, tp_size=2) != listener_port(
        6000, dp_rank=1, tp_rank=0, tp_size=2
    )
    assert RankEndpoint("127.0.0.1", 6000, dp_rank=1, tp_rank=1, tp_size=2).port == 6003


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"base_port": 0, "dp_rank": 0, "tp_rank": 0, "tp_size": 1}, "base_port"),
        ({"base_port": 6000, "dp_rank": -1, "tp_rank": 0, "tp_size": 1}, "dp_rank"),
        ({"base_port": 6000, "dp_rank": 0, "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"base_port": 6000, "dp_rank": 0, "tp_rank": 0, "tp_size": 0}, "tp_size"),
        ({"base_port": 65535, "dp_rank": 1, "tp_rank": 0, "tp_size": 1}, "exceeds 65535"),
    ],
)
def test_listener_port_rejects_bad_ranks(kwargs, name):
    base = kwargs.pop("base_port")
    with pytest.raises(ValueError, match=name):
        listener_port(base, **kwargs)
