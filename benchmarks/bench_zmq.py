"""Throughput of write_done messages through the ZMQ adapter versus raw pyzmq + msgpack.

Rules: like with like (same socket kinds on 127.0.0.1, connected and warmed before timing, same high-water
marks); the adapter adds validation, its I/O threads and the trust check; medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import msgpack
import zmq

from moriio_fsm.adapters.zmq import Role, TransportConfig, WriteDone, ZmqTransport

HOST = "127.0.0.1"


def adapter_round(
    sender: ZmqTransport, destination: tuple[str, int], box: dict, count: int
) -> float:
    box["seen"] = 0
    done = threading.Event()
    box["done"], box["target"] = done, count
    messages = [WriteDone(f"tx-{i:08d}", 1) for i in range(count)]
    start = time.perf_counter()
    for message in messages:
        sender.send(destination, message)
    if not done.wait(60):
        raise RuntimeError(
            f"adapter round stalled at {box['seen']}/{count} messages: {box.get('stats', dict)()}"
        )
    return count / (time.perf_counter() - start)


class RawPath:
    """The baseline: one DEALER -> ROUTER pair, bound, connected and warmed once.

    The same work as the adapter's path: the main thread encodes and sends through
    the DEALER, a receiving thread reads the ROUTER, decodes and delivers to a
    callback.  Built with the same high-water marks and linger as the adapter's
    sockets, and connected before any timing starts, as the adapter's cached sender is.
    """

    def __init__(self, ctx: zmq.Context, send_hwm: int, recv_hwm: int) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, recv_hwm)
        port = self.router.bind_to_random_port(f"tcp://{HOST}")
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.SNDHWM, send_hwm)
        self.dealer.connect(f"tcp://{HOST}:{port}")

    def round(self, count: int) -> float:
        router, dealer = self.router, self.dealer
        delivered: list = []
        ready = threading.Event()

        def receive() -> None:
            ready.set()
            for _ in range(count):
                _identity, payload = router.recv_multipart()
                data = msgpack.unpackb(payload)
                delivered.append((data["transfer_id"], data.get("num_writers", 1)))

        receiver = threading.Thread(target=receive)
        receiver.start()
        ready.wait()
        ids = [f"tx-{i:08d}" for i in range(count)]
        start = time.perf_counter()
        for transfer_id in ids:
            dealer.send(
                msgpack.packb({"type": "write_done", "transfer_id": transfer_id, "num_writers": 1})
            )
        receiver.join(60)
        elapsed = time.perf_counter() - start
        if len(delivered) != count:
            raise RuntimeError(f"raw round delivered {len(delivered)}/{count} messages")
        return count / elapsed

    def close(self) -> None:
        self.dealer.close()
        self.router.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()

    box: dict = {}

    def on_message(delivery) -> None:
        box["seen"] += 1
        if box["seen"] == box["target"]:
            box["done"].set()

    # A round is a burst of --messages sends: the adapter's send queue must hold
    # one burst (its send() never blocks, where the raw DEALER's send would wait),
    # and both paths get the same high-water marks.
    hwm = 4 * args.messages
    receiver = ZmqTransport(
        TransportConfig(role=Role.CONSUMER, bind_host=HOST, recv_hwm=hwm), on_message
    )
    sender = ZmqTransport(
        TransportConfig(
            role=Role.PRODUCER, bind_host=HOST, listen=False, send_hwm=hwm, max_queued_sends=hwm
        ),
        lambda d: None,
    )
    destination = (HOST, receiver.notify_port)
    box["stats"] = lambda: (sender.stats, receiver.stats)
    ctx = zmq.Context()
    raw = RawPath(ctx, send_hwm=hwm, recv_hwm=hwm)
    try:
        # Connect and warm up both paths before anything is timed.
        adapter_round(sender, destination, box, 2_000)
        raw.round(2_000)
        adapter_rates, raw_rates = [], []
        for _ in range(args.rounds):
            adapter_rates.append(adapter_round(sender, destination, box, args.messages))
            raw_rates.append(raw.round(args.messages))
    finally:
        sender.close()
        receiver.close()
        raw.close()
        ctx.term()
    adapter_rate = statistics.median(adapter_rates)
    raw_rate = statistics.median(raw_rates)
    print(f"adapter: median {adapter_rate:,.0f} msg/s over {args.rounds} rounds of {args.messages}")
    print(f"raw pyzmq + msgpack: median {raw_rate:,.0f} msg/s")
    print(f"zmq_throughput_ratio: {adapter_rate / raw_rate:.3f}")


if __name__ == "__main__":
    main()
