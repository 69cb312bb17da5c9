"""CURVE on: keyless and unauthorised peers are refused, keyed peers talk; ZAP verdicts are also tested directly.

Rules: live sockets on 127.0.0.1 only, every wait bounded, skipped where libzmq lacks CURVE; a refusal shows as
the ZAP handler's counted verdict and an inbox that stays empty.
"""

from __future__ import annotations

import queue
import time

import msgpack
import pytest
import zmq

from moriio_fsm.adapters.zmq import (
    AgentMetadata,
    CurveConfig,
    HandshakeFailedError,
    HandshakeReply,
    PeerPolicy,
    Role,
    TransportConfig,
    WriteDone,
    ZmqTransport,
)
from moriio_fsm.adapters.zmq.zap import zap_reply

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE"),
]

HOST = "127.0.0.1"
WAIT_S = 10.0


@pytest.fixture
def shared_keys() -> CurveConfig:
    return CurveConfig.generate()


@pytest.fixture
def secured_consumer(shared_keys):
    inbox: queue.Queue = queue.Queue()
    transport = ZmqTransport(
        TransportConfig(role=Role.CONSUMER, bind_host=HOST, curve=shared_keys), inbox.put
    )
    yield transport, inbox
    transport.close()


def _raw_dealer(
    ctx: zmq.Context,
    port: int,
    keys: tuple[bytes, bytes] | None = None,
    server_key: bytes | None = None,
):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
    sock.connect(f"tcp://{HOST}:{port}")
    return sock


def test_keyed_peer_talks_and_keyless_or_unauthorised_peers_are_refused(
    shared_keys, secured_consumer
):
    receiver, inbox = secured_consumer
    ctx = zmq.Context()
    keyless = _raw_dealer(ctx, receiver.notify_port)
    stranger = _raw_dealer(ctx, receiver.notify_port, zmq.curve_keypair(), shared_keys.public_key)
    try:
        keyless.send(msgpack.dumps({"type": "write_done", "transfer_id": "tx-keyless"}))
        stranger.send(msgpack.dumps({"type": "write_done", "transfer_id": "tx-stranger"}))
        with ZmqTransport(
            TransportConfig(role=Role.PRODUCER, bind_host=HOST, listen=False, curve=shared_keys),
            lambda d: None,
        ) as sender:
            sender.send((HOST, receiver.notify_port), WriteDone("tx-keyed"))
            assert inbox.get(timeout=WAIT_S).message == WriteDone("tx-keyed")
        # The stranger's CURVE handshake reaches the ZAP check and is refused there.
        deadline = time.monotonic() + WAIT_S
        while receiver.stats["auth_refused"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.stats["auth_refused"] >= 1
        # Give the refused peers time they would need if they could get through.
        time.sleep(0.3)
        assert inbox.empty()
        assert receiver.stats["received"] == 1
    finally:
        keyless.close(linger=0)
        stranger.close(linger=0)
        ctx.term()


def test_an_authorised_client_key_of_another_pair_is_admitted(shared_keys):
    client = CurveConfig.generate()
    server = CurveConfig(
        shared_keys.public_key, shared_keys.secret_key, frozenset({client.public_key})
    )
    client_view = CurveConfig(
        client.public_key, client.secret_key, server_keys={HOST: shared_keys.public_key}
    )
    inbox: queue.Queue = queue.Queue()
    with (
        ZmqTransport(
            TransportConfig(role=Role.CONSUMER, bind_host=HOST, curve=server), inbox.put
        ) as receiver,
        ZmqTransport(
            TransportConfig(role=Role.PRODUCER, bind_host=HOST, listen=False, curve=client_view),
            lambda d: None,
        ) as sender,
    ):
        sender.send((HOST, receiver.notify_port), WriteDone("tx-authorised"))
        assert inbox.get(timeout=WAIT_S).message == WriteDone("tx-authorised")


def test_handshake_requires_keys_when_curve_is_on(shared_keys):
    reply = HandshakeReply(AgentMetadata("p", b"desc", (1,), 2, 3, "FA"), {"l": (b"m",)})
    config = TransportConfig(role=Role.PRODUCER, bind_host=HOST, listen=False, curve=shared_keys)
    with (
        ZmqTransport(config, lambda d: None) as server,
        ZmqTransport(
            TransportConfig(role=Role.CONSUMER, bind_host=HOST, curve=shared_keys), lambda d: None
        ) as keyed,
        ZmqTransport(
            TransportConfig(role=Role.CONSUMER, bind_host=HOST), lambda d: None
        ) as keyless,
    ):
        port = server.serve_handshake(reply, bind_host=HOST)
        assert (
            keyed.request_handshake((HOST, port), timeout_s=WAIT_S).result(WAIT_S).metadata
            == reply.metadata
        )
        with pytest.raises(HandshakeFailedError):
            keyless.request_handshake((HOST, port), timeout_s=0.3).result(WAIT_S)


def test_zap_handler_refuses_anything_but_an_authorised_curve_key():
    keys = CurveConfig.generate()
    authorised = keys.authorized_raw_keys()
    good = next(iter(authorised))
    base = [b"1.0", b"7", b"moriio", b"127.0.0.1", b""]
    assert zap_reply(base + [b"CURVE", good], authorised)[1] is None
    assert zap_reply(base + [b"CURVE", b"\x00" * 32], authorised)[1] == "client key not authorised"
    assert "refused" in zap_reply(base + [b"NULL"], authorised)[1]
    assert zap_reply([b"1.0"], authorised)[1] == "malformed ZAP request"
    assert zap_reply(base + [b"CURVE", good], authorised)[0][2] == b"200"


def test_malformed_keys_are_named():
    with pytest.raises(ValueError, match="public_key"):
        CurveConfig(b"short", zmq.curve_keypair()[1])


def test_server_keys_are_found_by_any_spelling_of_the_host():
    public, secret = zmq.curve_keypair()
    ipv6_key, name_key = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    config = CurveConfig(public, secret, server_keys={"[0:0::1]": ipv6_key, "Node-A.": name_key})
    # The transport looks keys up by the canonical text PeerPolicy.check returns.
    policy = PeerPolicy(["::1", "node-a"])
    assert config.server_key_for(policy.check("::1")) == ipv6_key
    assert config.server_key_for(policy.check("NODE-A")) == name_key
    assert config.server_key_for(policy.check("::0:1")) == ipv6_key
    with pytest.raises(ValueError, match=r"server_keys\['no such host!'\]"):
        CurveConfig(public, secret, server_keys={"no such host!": ipv6_key})
    with pytest.raises(ValueError, match="same host '::1' with a different key"):
        CurveConfig(public, secret, server_keys={"::1": ipv6_key, "[::1]": name_key})


def test_a_message_names_the_key_it_came_with_and_a_transfer_expects_its_hosts_key(shared_keys):
    """Two peers with authorised keys on one host: the listener tells them apart by key, so a
    transfer bound to one host's key refuses the other's messages (see tests/runtime)."""
    from zmq.utils import z85

    from moriio_fsm.adapters.zmq.senders import AddressCache, expected_senders

    other = CurveConfig.generate()
    server = CurveConfig(
        shared_keys.public_key, shared_keys.secret_key, frozenset({other.public_key})
    )
    other_view = CurveConfig(
        other.public_key, other.secret_key, server_keys={HOST: shared_keys.public_key}
    )
    inbox: queue.Queue = queue.Queue()
    with ZmqTransport(
        TransportConfig(role=Role.CONSUMER, bind_host=HOST, curve=server), inbox.put
    ) as receiver:
        for keys in (shared_keys, other_view):
            with ZmqTransport(
                TransportConfig(role=Role.PRODUCER, bind_host=HOST, listen=False, curve=keys),
                lambda d: None,
            ) as sender:
                sender.send((HOST, receiver.notify_port), WriteDone("tx-keyed"))
                delivery = inbox.get(timeout=WAIT_S)
                assert (
                    delivery.source.split("#")[0] == f"{HOST}/{z85.decode(keys.public_key).hex()}"
                )
    # The peer at HOST is expected with the key server_keys names for it (here: its own pair).
    bound = expected_senders(HOST, server, AddressCache())
    assert bound == f"{HOST}/{z85.decode(shared_keys.public_key).hex()}"
