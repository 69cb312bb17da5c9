"""Who may connect to a listener, and who a message is charged to, against peers that lie.

Rules: live sockets on 127.0.0.1 and 127.0.0.2 (another address of this host) only, every
wait bounded; a refused connection shows as a counted ZAP verdict and an inbox that stays
empty; anything that could crash libzmq runs in a child process whose exit is checked.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from moriio_fsm.adapters.zmq import Role, TransportConfig, WriteDone, ZmqTransport, encode_notify
from moriio_fsm.adapters.zmq.sockets import source_for, tcp_url

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def dealer(ctx, port, source, routing_id=None):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(f"tcp://{source}:0;127.0.0.1:{port}")
    return sock


def test_a_message_is_charged_to_the_address_it_came_from_even_on_a_departed_peers_identity():
    inbox: queue.Queue = queue.Queue()
    ctx = zmq.Context()
    with ZmqTransport(TransportConfig(Role.CONSUMER, bind_host="127.0.0.1"), inbox.put) as listener:
        honest = dealer(ctx, listener.notify_port, "127.0.0.1", b"peer-1")
        honest.send(encode_notify(WriteDone("tx-1", 1)))
        assert inbox.get(timeout=WAIT_S).peer.address == "127.0.0.1"
        honest.close(linger=0)
        time.sleep(0.3)  # that connection is gone; its identity is free
        forger = dealer(ctx, listener.notify_port, "127.0.0.2", b"peer-1")
        forger.send(encode_notify(WriteDone("tx-1", 1)))
        delivery = inbox.get(timeout=WAIT_S)
        forger.close(linger=0)
    ctx.term()
    assert delivery.peer.address == "127.0.0.2"
    assert delivery.source.startswith("127.0.0.2#")


def test_a_connection_from_an_untrusted_address_is_refused_before_it_can_send_anything():
    inbox: queue.Queue = queue.Queue()
    ctx = zmq.Context()
    config = TransportConfig(Role.CONSUMER, bind_host="127.0.0.1", trusted_peers=("127.0.0.1",))
    with ZmqTransport(config, inbox.put) as listener:
        stranger = dealer(ctx, listener.notify_port, "127.0.0.2")
        stranger.send(encode_notify(WriteDone("tx-stranger", 1)))
        deadline = time.monotonic() + WAIT_S
        while listener.stats["auth_refused"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        trusted = dealer(ctx, listener.notify_port, "127.0.0.1")
        trusted.send(encode_notify(WriteDone("tx-trusted", 1)))
        assert inbox.get(timeout=WAIT_S).message.transfer_id == "tx-trusted"
        time.sleep(0.2)
        assert inbox.empty() and listener.stats["auth_refused"] >= 1
        assert listener.stats["received"] == 1
        stranger.close(linger=0)
        trusted.close(linger=0)
    ctx.term()


def test_a_trusted_name_admits_the_addresses_it_resolves_to():
    inbox: queue.Queue = queue.Queue()
    ctx = zmq.Context()
    config = TransportConfig(Role.CONSUMER, bind_host="127.0.0.1", trusted_peers=("localhost",))
    with ZmqTransport(config, inbox.put) as listener:
        peer = dealer(ctx, listener.notify_port, "127.0.0.1")
        peer.send(encode_notify(WriteDone("tx-named", 1)))
        assert inbox.get(timeout=WAIT_S).message.transfer_id == "tx-named"
        peer.close(linger=0)
    ctx.term()


COLLIDE = textwrap.dedent("""
    import struct, sys, time, zmq
    from moriio_fsm.adapters.zmq import Role, TransportConfig, WriteDone, ZmqTransport, encode_notify
    got = []
    config = TransportConfig(Role.CONSUMER, bind_host="127.0.0.1", trusted_peers=("127.0.0.1",))
    listener = ZmqTransport(config, got.append)
    ctx = zmq.Context()
    def dealer(source, routing_id=None):
        s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            s.setsockopt(zmq.ROUTING_ID, routing_id)
        s.connect(f"tcp://{source}:0;127.0.0.1:{listener.notify_port}")
        s.send(encode_notify(WriteDone("tx", 1)))
        return s
    keep = [dealer("127.0.0.1")]
    deadline = time.time() + 10
    while not got and time.time() < deadline:
        time.sleep(0.01)
    first = struct.unpack(">I", got[0].peer.identity[1:])[0]
    # An untrusted host claims the identities libzmq will give the next peers ...
    keep += [dealer("127.0.0.2", b"\\x00" + struct.pack(">I", first + n)) for n in range(1, 6)]
    time.sleep(0.5)
    # ... and honest peers connect: libzmq would abort on the collision.
    keep += [dealer("127.0.0.1") for _ in range(3)]
    deadline = time.time() + 10
    while len(got) < 4 and time.time() < deadline:
        time.sleep(0.01)
    print(len(got), listener.stats["auth_refused"])
    listener.close()
""")


def test_an_untrusted_host_claiming_libzmqs_next_identities_cannot_abort_the_listener():
    child = subprocess.run(
        [sys.executable, "-c", COLLIDE], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr[-2000:]
    delivered, refused = map(int, child.stdout.split())
    assert delivered == 4 and refused >= 5


@pytest.mark.parametrize(
    "local, host, expected",
    [
        ("198.18.0.2", "198.18.0.3", "198.18.0.2"),
        ("127.0.0.1", "127.0.0.2", "127.0.0.1"),
        ("127.0.0.1", "198.18.0.3", None),  # loopback cannot reach another host
        ("198.18.0.2", "2001:db8::1", None),  # another family
        ("0.0.0.0", "198.18.0.3", None),  # a wildcard is no address to leave from
        ("198.18.0.2", "decode-0", None),  # a name: the kernel chooses
        (None, "198.18.0.3", None),
    ],
)
def test_senders_leave_from_the_address_their_transport_listens_on(local, host, expected):
    assert source_for(local, host) == expected


def test_the_source_goes_into_the_endpoint_in_zeromqs_syntax():
    assert tcp_url("198.18.0.3", 5, "198.18.0.2") == "tcp://198.18.0.2:0;198.18.0.3:5"
    assert tcp_url("2001:db8::1", 5, "2001:db8::2") == "tcp://[2001:db8::2]:0;[2001:db8::1]:5"
    assert tcp_url("198.18.0.3", 5) == "tcp://198.18.0.3:5"


def test_a_transports_messages_come_from_the_address_it_listens_on():
    inbox: queue.Queue = queue.Queue()
    with (
        ZmqTransport(TransportConfig(Role.CONSUMER, bind_host="127.0.0.1"), inbox.put) as listener,
        ZmqTransport(
            TransportConfig(Role.PRODUCER, bind_host="127.0.0.2", listen=False), lambda d: None
        ) as sender,
    ):
        sender.send(("127.0.0.1", listener.notify_port), WriteDone("tx-src", 1))
        assert inbox.get(timeout=WAIT_S).peer.address == "127.0.0.2"
