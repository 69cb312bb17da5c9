"""Live transport on 127.0.0.1: the listener survives junk, sends are thread-safe, untrusted peers are refused
before dialling, failures are reported, handshakes work, and each delivery names the connection it came over.
"""

from __future__ import annotations

import queue
import threading
import time

import msgpack
import pytest
import zmq

from moriio_fsm.adapters.zmq import (
    AgentMetadata,
    HandshakeFailedError,
    HandshakeReply,
    RankEndpoint,
    RemoteBlocks,
    Role,
    TransportBusyError,
    TransportClosedError,
    TransportConfig,
    UntrustedPeerError,
    WireEncodeError,
    WireLimits,
    WriteDone,
    WriteFailed,
    ZmqTransport,
    encode_notify,
    event_for,
)

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
WAIT_S = 10.0


class Inbox:
    """Collects deliveries from the I/O thread for the test thread."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, delivery) -> None:
        self.items.put(delivery)

    def get(self):
        return self.items.get(timeout=WAIT_S)

    def take(self, count: int) -> list:
        return [self.get() for _ in range(count)]


@pytest.fixture
def consumer():
    inbox = Inbox()
    transport = ZmqTransport(TransportConfig(role=Role.CONSUMER, bind_host=HOST), inbox)
    yield transport, inbox
    transport.close()


@pytest.fixture
def producer():
    failures: queue.Queue = queue.Queue()
    transport = ZmqTransport(
        TransportConfig(role=Role.PRODUCER, bind_host=HOST, send_timeout_s=0.3),
        Inbox(),
        on_send_failure=failures.put,
    )
    yield transport, failures
    transport.close()


@pytest.fixture
def raw_dealer():
    ctx = zmq.Context()
    sockets = []

    def connect(port: int) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{HOST}:{port}")
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close(linger=0)
    ctx.term()


def test_listener_binds_the_configured_address_only(consumer):
    transport, _ = consumer
    assert transport.bind_host == HOST
    assert transport.notify_port and transport.notify_port > 0


def test_message_is_delivered_with_its_peer_and_becomes_an_event_from_that_peer(consumer, producer):
    receiver, inbox = consumer
    sender, _ = producer
    sender.send((HOST, receiver.notify_port), WriteDone("tx-1", num_writers=2))
    delivery = inbox.get()
    assert delivery.message == WriteDone("tx-1", 2)
    assert delivery.peer.address == HOST
    assert delivery.peer.identity
    assert delivery.source == f"{HOST}#{delivery.peer.identity.hex()}"
    event = event_for(delivery.message, delivery.received_at, delivery.source)
    assert (event.transfer_id, event.kind, dict(event.data)) == (
        "tx-1",
        "write_done",
        {"num_writers": 2, "producer_rank": -1},
    )
    assert (event.time, event.source) == (delivery.received_at, delivery.source)


def test_source_is_stable_over_one_connection_and_differs_between_connections(consumer, raw_dealer):
    receiver, inbox = consumer
    first, second = raw_dealer(receiver.notify_port), raw_dealer(receiver.notify_port)
    first.send(encode_notify(WriteDone("tx-a")))
    [a] = inbox.take(1)  # in order: the first connection is known before the second sends
    second.send(encode_notify(WriteDone("tx-b")))
    [b] = inbox.take(1)
    first.send(encode_notify(WriteFailed("tx-a")))
    [again] = inbox.take(1)
    assert [d.message.transfer_id for d in (a, b, again)] == ["tx-a", "tx-b", "tx-a"]
    assert a.source == again.source
    assert a.source != b.source
    assert a.source.startswith(f"{HOST}#") and b.source.startswith(f"{HOST}#")


def test_listener_survives_a_run_of_malformed_messages(consumer, raw_dealer):
    receiver, inbox = consumer
    dealer = raw_dealer(receiver.notify_port)
    junk = [
        b"",
        b"\xff\xfe",
        msgpack.dumps({"type": "nope", "transfer_id": "t"}),
        msgpack.dumps({"type": "write_done"}),
        msgpack.dumps(
            {"type": "remote_blocks", "transfer_id": "t", "req_id": "r", "block_notify_list": []}
        ),
        msgpack.dumps(
            {"type": "release", "transfer_id": "t"}
        ),  # for the producer, not this consumer
        msgpack.dumps([1, 2, 3]),
        b"\x81\xa4type" + b"\x91" * 3000,
    ]
    for frame in junk:
        dealer.send(frame)
    dealer.send_multipart([b"two", b"frames"])
    dealer.send(msgpack.dumps({"type": "write_failed", "transfer_id": "tx-ok"}))
    delivery = inbox.get()
    assert delivery.message == WriteFailed("tx-ok")
    assert inbox.items.empty()
    stats = receiver.stats
    assert stats["rejected"] == len(junk) + 1
    assert stats["delivered"] == 1


def test_a_raising_callback_does_not_stop_the_listener(raw_dealer):
    seen: queue.Queue = queue.Queue()

    def callback(delivery) -> None:
        seen.put(delivery.message.transfer_id)
        if delivery.message.transfer_id == "boom":
            raise RuntimeError("consumer bug")

    with ZmqTransport(TransportConfig(role=Role.CONSUMER, bind_host=HOST), callback) as receiver:
        dealer = raw_dealer(receiver.notify_port)
        dealer.send(b"boom")
        dealer.send(b"after")
        assert [seen.get(timeout=WAIT_S), seen.get(timeout=WAIT_S)] == ["boom", "after"]
        assert receiver.stats["callback_errors"] == 1


def test_oversized_frames_are_refused_and_the_listener_keeps_serving(raw_dealer):
    inbox = Inbox()
    config = TransportConfig(
        role=Role.CONSUMER, bind_host=HOST, limits=WireLimits(max_message_bytes=1024)
    )
    with ZmqTransport(config, inbox) as receiver:
        flooder = raw_dealer(receiver.notify_port)
        flooder.send(b"x" * 100_000)  # libzmq drops this connection (MAXMSGSIZE)
        honest = raw_dealer(receiver.notify_port)
        honest.send(msgpack.dumps({"type": "write_done", "transfer_id": "tx-small"}))
        assert inbox.get().message == WriteDone("tx-small")
        assert inbox.items.empty()


def test_sends_from_many_threads_all_arrive_complete(consumer, producer):
    receiver, inbox = consumer
    sender, failures = producer
    threads, per_thread = 8, 250
    destination = RankEndpoint(HOST, receiver.notify_port)
    start = threading.Barrier(threads)

    def worker(index: int) -> None:
        start.wait()
        for n in range(per_thread):
            sender.send(destination, WriteDone(f"tx-{index}-{n}", num_writers=index + 1))

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(WAIT_S)
    received = inbox.take(threads * per_thread)
    assert sorted(d.message.transfer_id for d in received) == sorted(
        f"tx-{i}-{n}" for i in range(threads) for n in range(per_thread)
    )
    assert all(
        d.message.num_writers == int(d.message.transfer_id.split("-")[1]) + 1 for d in received
    )
    assert failures.empty()


def test_remote_blocks_reach_the_producer_intact():
    inbox = Inbox()
    with (
        ZmqTransport(TransportConfig(role=Role.PRODUCER, bind_host=HOST), inbox) as prefill,
        ZmqTransport(
            TransportConfig(role=Role.CONSUMER, bind_host=HOST, listen=False), Inbox()
        ) as decode,
    ):
        blocks = tuple(range(0, 20_000, 3))
        decode.send(
            (HOST, prefill.notify_port),
            RemoteBlocks("tx-big", "req-9", (blocks, (1, 2)), decode_rank=2),
        )
        message = inbox.get().message
        assert message.block_ids == (blocks, (1, 2))
        assert (message.req_id, message.decode_rank) == ("req-9", 2)


@pytest.mark.parametrize("host", ["10.0.0.8", "169.254.169.254", "example.com", "127.1", "0.0.0.0"])
def test_untrusted_destinations_are_refused_before_any_socket(producer, host):
    sender, failures = producer
    with pytest.raises(UntrustedPeerError):
        sender.send((host, 5555), WriteDone("tx"))
    with pytest.raises(UntrustedPeerError):
        sender.request_handshake((host, 5555))
    assert sender.stats["senders_opened"] == 0
    assert failures.empty()


def test_configured_peers_replace_the_loopback_default():
    config = TransportConfig(
        role=Role.PRODUCER, bind_host=HOST, listen=False, trusted_peers=("10.20.0.0/16",)
    )
    with ZmqTransport(config, Inbox()) as sender:
        with pytest.raises(UntrustedPeerError, match="not in the trusted peers"):
            sender.send((HOST, 5555), WriteDone("tx"))
        assert sender.policy.is_trusted("10.20.3.4")


def test_invalid_outgoing_values_are_refused_to_the_caller(producer):
    sender, _ = producer
    with pytest.raises(WireEncodeError, match="num_writers"):
        sender.send((HOST, 5555), WriteDone("tx", num_writers=0))
    with pytest.raises(ValueError, match="port"):
        sender.send((HOST, 70_000), WriteDone("tx"))


def test_a_peer_that_never_answers_is_reported_as_a_failed_send(producer):
    sender, failures = producer
    with socket_port() as dead_port:  # a port with no listener
        sender.send((HOST, dead_port), WriteFailed("tx-lost"))
        failure = failures.get(timeout=WAIT_S)
    assert (failure.transfer_id, failure.kind, failure.port) == (
        "tx-lost",
        "write_failed",
        dead_port,
    )
    assert "send timeout" in failure.reason


def test_least_recently_used_sender_is_closed_when_the_cache_is_full():
    inboxes = [Inbox() for _ in range(3)]
    receivers = [
        ZmqTransport(TransportConfig(role=Role.CONSUMER, bind_host=HOST), box) for box in inboxes
    ]
    config = TransportConfig(role=Role.PRODUCER, bind_host=HOST, listen=False, max_peers=2)
    try:
        with ZmqTransport(config, Inbox()) as sender:
            for round_ in range(2):
                for index, receiver in enumerate(receivers):
                    sender.send((HOST, receiver.notify_port), WriteDone(f"tx-{round_}-{index}"))
                    assert inboxes[index].get().message.transfer_id == f"tx-{round_}-{index}"
            # Two cached senders for three peers used round-robin: every use reopens one.
            assert sender.stats["senders_opened"] == 6
    finally:
        for receiver in receivers:
            receiver.close()


def test_handshake_round_trip_and_timeout(consumer, producer):
    receiver, _ = consumer
    sender, _ = producer
    reply = HandshakeReply(
        AgentMetadata("prefill-0", b"engine-desc", (4096, 8192), 64, 4096, "FA"),
        {"layers.0": (b"mem-k", b"mem-v")},
    )
    port = sender.serve_handshake(reply, bind_host=HOST)
    got = receiver.request_handshake((HOST, port), timeout_s=WAIT_S).result(WAIT_S)
    assert got.metadata == reply.metadata
    assert dict(got.layer_memory) == {"layers.0": (b"mem-k", b"mem-v")}
    with socket_port() as dead_port:
        future = receiver.request_handshake((HOST, dead_port), timeout_s=0.2)
        with pytest.raises(HandshakeFailedError, match="no handshake reply"):
            future.result(WAIT_S)


def test_handshake_server_ignores_junk_requests(producer, raw_dealer):
    sender, _ = producer
    reply = HandshakeReply(AgentMetadata("p", b"d", (), 1, 1, "FA"), {"l": (b"m",)})
    port = sender.serve_handshake(reply, bind_host=HOST)
    dealer = raw_dealer(port)
    dealer.send(b"pop_everything")
    dealer.send(b"get_meta_msg")
    empty, metadata = dealer.recv_multipart()
    assert empty == b"" and msgpack.loads(metadata)["engine_id"] == "p"


def test_closed_transport_refuses_work_and_fails_pending_handshakes():
    transport = ZmqTransport(TransportConfig(role=Role.CONSUMER, bind_host=HOST), Inbox())
    with socket_port() as dead_port:
        pending = transport.request_handshake((HOST, dead_port), timeout_s=30)
        transport.close()
    with pytest.raises(HandshakeFailedError, match="closed"):
        pending.result(WAIT_S)
    with pytest.raises(TransportClosedError):
        transport.send((HOST, dead_port), WriteDone("tx"))
    transport.close()  # idempotent


def test_configuration_errors_name_the_setting():
    with pytest.raises(ValueError, match="tp_rank"):
        TransportConfig(role=Role.CONSUMER, notify_base_port=6000, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="role"):
        TransportConfig(role="consumer")
    with pytest.raises(ValueError, match="trusted_peers"):
        TransportConfig(role=Role.CONSUMER, trusted_peers="10.0.0.1")


def test_listener_port_follows_the_rank_rule():
    with socket_port() as base:
        config = TransportConfig(
            role=Role.CONSUMER,
            bind_host=HOST,
            notify_base_port=base - 3,
            dp_rank=1,
            tp_rank=1,
            tp_size=2,
        )
        assert config.notify_port == base
    with ZmqTransport(config, Inbox()) as transport:
        assert transport.notify_port == base


class socket_port:
    """A loopback TCP port that was free a moment ago (nothing listens on it)."""

    def __enter__(self) -> int:
        import socket

        probe = socket.socket()
        probe.bind((HOST, 0))
        self.port = probe.getsockname()[1]
        probe.close()
        return self.port

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------- failures of the I/O thread itself


def test_socket_creation_errors_fail_their_own_work_and_the_transport_keeps_serving(consumer):
    receiver, inbox = consumer
    failures: queue.Queue = queue.Queue()
    config = TransportConfig(
        role=Role.PRODUCER,
        bind_host=HOST,
        listen=False,
        max_pending_handshakes=1_100,
        max_queued_commands=1_100,
    )
    with (
        ZmqTransport(config, Inbox(), on_send_failure=failures.put) as sender,
        socket_port() as dead_port,
    ):
        # libzmq allows 1023 sockets per context: the handshakes beyond that fail at once.
        futures = [sender.request_handshake((HOST, dead_port), timeout_s=5.0) for _ in range(1_100)]
        with pytest.raises(HandshakeFailedError, match="could not start a handshake"):
            futures[-1].result(WAIT_S)
        # Every socket is taken, so this send cannot get one: reported, not lost.
        sender.send((HOST, receiver.notify_port), WriteDone("tx-no-socket"))
        failure = failures.get(timeout=WAIT_S)
        assert failure.transfer_id == "tx-no-socket"
        assert "could not open a sender socket" in failure.reason
        for future in futures:  # the rest time out and give their sockets back
            with pytest.raises(HandshakeFailedError):
                future.result(WAIT_S)
        sender.send((HOST, receiver.notify_port), WriteDone("tx-after"))
        assert inbox.get().message == WriteDone("tx-after")
        assert (
            sender.stats["io_errors"] == 0
        )  # contained where they happened, not by the last resort


def test_if_the_io_thread_stops_the_transport_is_closed_and_queued_work_is_failed(monkeypatch):
    failures: queue.Queue = queue.Queue()
    config = TransportConfig(role=Role.PRODUCER, bind_host=HOST, listen=False)
    transport = ZmqTransport(config, Inbox(), on_send_failure=failures.put)
    with socket_port() as dead_port:
        pending = transport.request_handshake((HOST, dead_port), timeout_s=60)

        def broken_poll(*_args):
            raise RuntimeError("poller broke")

        monkeypatch.setattr(transport._poller, "poll", broken_poll)
        try:
            transport.send((HOST, dead_port), WriteDone("tx-queued"))
            queued = True
        except TransportClosedError:
            queued = False
        transport._thread.join(WAIT_S)
        assert not transport._thread.is_alive()
        with pytest.raises(HandshakeFailedError, match="closed"):
            pending.result(WAIT_S)
        if queued:
            assert failures.get(timeout=WAIT_S).transfer_id == "tx-queued"
        with pytest.raises(TransportClosedError):
            transport.send((HOST, dead_port), WriteDone("tx-late"))
        with pytest.raises(TransportClosedError):
            transport.request_handshake((HOST, dead_port))
    transport.close()
    assert transport._wake_write == -1  # close() still releases the pipe


# ---------------------------------------------------------------- bounds


class BlockedIoThread:
    """Holds a transport's I/O thread inside its on_message callback, so work piles up."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, delivery) -> None:
        self.entered.set()
        self.release.wait(WAIT_S)

    def block(self, transport: ZmqTransport, dealer: zmq.Socket) -> None:
        dealer.send(b"tx-block")
        assert self.entered.wait(WAIT_S)


def test_sends_beyond_the_queue_bound_are_refused(consumer, raw_dealer):
    receiver, inbox = consumer
    blocked = BlockedIoThread()
    config = TransportConfig(role=Role.CONSUMER, bind_host=HOST, max_queued_sends=5)
    with ZmqTransport(config, blocked) as sender:
        blocked.block(sender, raw_dealer(sender.notify_port))
        destination = (HOST, receiver.notify_port)
        for n in range(5):
            sender.send(destination, WriteDone(f"tx-{n}"))
        with pytest.raises(TransportBusyError, match="max_queued_sends"):
            sender.send(destination, WriteDone("tx-over"))
        blocked.release.set()
        assert sorted(d.message.transfer_id for d in inbox.take(5)) == [f"tx-{n}" for n in range(5)]
        sender.send(destination, WriteDone("tx-room-again"))
        assert inbox.get().message.transfer_id == "tx-room-again"


def test_commands_and_pending_handshakes_are_bounded(raw_dealer):
    blocked = BlockedIoThread()
    config = TransportConfig(
        role=Role.CONSUMER, bind_host=HOST, max_queued_commands=4, max_pending_handshakes=2
    )
    with ZmqTransport(config, blocked) as transport, socket_port() as dead_port:
        blocked.block(transport, raw_dealer(transport.notify_port))
        first = transport.request_handshake((HOST, dead_port), timeout_s=30)
        transport.request_handshake((HOST, dead_port), timeout_s=30)
        with pytest.raises(TransportBusyError, match="max_pending_handshakes"):
            transport.request_handshake((HOST, dead_port))
        assert first.cancel()  # a finished handshake frees its slot
        transport.request_handshake((HOST, dead_port), timeout_s=30)
        with pytest.raises(TransportBusyError, match="did not bind"):
            transport.serve_handshake(
                HandshakeReply(AgentMetadata("p", b"d", (), 1, 1, "FA"), {}),
                bind_host=HOST,
                timeout_s=0.2,
            )
        # Three handshakes (one cancelled) and the abandoned serve fill the command queue.
        reply = HandshakeReply(AgentMetadata("p", b"d", (), 1, 1, "FA"), {})
        with pytest.raises(TransportBusyError, match="max_queued_commands"):
            transport.serve_handshake(reply, bind_host=HOST)
        blocked.release.set()
        deadline = time.monotonic() + WAIT_S
        while True:  # room comes back once the I/O thread has drained the queue
            try:
                assert transport.serve_handshake(reply, bind_host=HOST) > 0
                break
            except TransportBusyError:
                assert time.monotonic() < deadline
                time.sleep(0.01)


def test_a_late_wake_up_never_writes_to_a_closed_and_reused_descriptor(monkeypatch):
    import os

    from moriio_fsm.adapters.zmq import transport as transport_module

    transport = ZmqTransport(TransportConfig(role=Role.CONSUMER, bind_host=HOST), Inbox())
    sentinel_read, sentinel_write = os.pipe()
    os.set_blocking(sentinel_read, False)
    caller = threading.current_thread()
    reused: list[int] = []

    class RacingOs:
        """``os`` whose first write from the test thread lets close() run first."""

        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            if threading.current_thread() is caller and not reused:
                closer = threading.Thread(target=transport.close)
                closer.start()
                closer.join(1.0)
                if not closer.is_alive():  # the pipe was closed under this write: reuse its number
                    os.dup2(sentinel_write, fd)
                reused.append(fd if not closer.is_alive() else -1)
            return os.write(fd, data)

    monkeypatch.setattr(transport_module, "os", RacingOs())
    try:
        transport.send((HOST, transport.notify_port), WriteDone("tx-wake"))
    except TransportClosedError:
        pass
    transport.close()
    try:
        with pytest.raises(BlockingIOError):
            os.read(sentinel_read, 16)  # nothing was written into the unrelated pipe
    finally:
        for fd in (sentinel_read, sentinel_write, *[fd for fd in reused if fd >= 0]):
            os.close(fd)


def test_default_bind_host_finds_an_ipv6_address_when_ipv4_has_no_route(monkeypatch):
    import socket

    from moriio_fsm.adapters.zmq import hosts

    routes = {socket.AF_INET: None, socket.AF_INET6: "2001:db8::5"}
    monkeypatch.setattr(hosts, "_route_address", lambda family, target: routes.get(family))
    assert hosts.default_bind_host() == "2001:db8::5"


def test_default_bind_host_skips_an_ipv6_answer_a_python_without_ipv6_cannot_read(monkeypatch):
    import socket

    from moriio_fsm.adapters.zmq import hosts

    # Built without IPv6, Python gives an AF_INET6 answer's address as (int, bytes).
    answers = [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (10, b"\x00" * 16)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("198.18.0.4", 0)),
    ]
    monkeypatch.setattr(hosts, "_route_address", lambda family, target: None)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answers)
    assert hosts.default_bind_host() == "198.18.0.4"


def test_default_bind_host_is_a_concrete_address():
    import ipaddress

    from moriio_fsm.adapters.zmq import default_bind_host

    assert not ipaddress.ip_address(default_bind_host()).is_unspecified
