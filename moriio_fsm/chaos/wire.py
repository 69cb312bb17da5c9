"""The control channel of a chaos run: every message is encoded by the real wire codec,
carried as bytes over a channel that may lose, duplicate and delay it, decoded by the
receiver and turned into its event by ``event_for``.

Rules: what happens to a message (lost, copied, how late) is drawn from the run's seeded
random generator when it is sent; a message to or from a rank that crashed is lost. A
frame the receiver cannot decode is counted, never raised (a real listener drops it).
"""

from __future__ import annotations

from collections.abc import Callable

from ..adapters.zmq import (
    HANDSHAKE_REQUEST,
    AgentMetadata,
    HandshakeReply,
    NotifyMessage,
    Role,
    WireDecodeError,
    decode_handshake_reply,
    decode_handshake_request,
    decode_notify,
    encode_handshake_reply,
    encode_notify,
)
from ..adapters.zmq.events import event_for
from .fabric import BLOCK_BYTES, BLOCKS, Fabric
from .world import World

#: A message's ordinary trip (virtual seconds), and how late a delayed one comes.
LATENCY_S = (0.0005, 0.0015)
LATE_S = (1.0, 4.0)


class Channel:
    """Carries frames between ranks on the run's virtual clock."""

    def __init__(self, world: World, fabric: Fabric):
        self.world = world
        self.fabric = fabric
        self.rng = world.rng
        self.rate = world.settings.fault_rate
        self.sent = self.lost = self.duplicated = self.delayed = self.undecodable = 0

    def send(
        self,
        sender: str,
        receiver: str,
        frames: tuple[bytes, ...],
        arrive: Callable[[tuple[bytes, ...]], None],
    ) -> None:
        self.sent += 1
        roll = self.rng.random
        if not self.world.alive(sender) or roll() < self.rate:
            self.lost += 1
            return
        copies = 1
        if roll() < self.rate:
            copies = 2
            self.duplicated += 1

        def deliver() -> None:
            if self.world.alive(receiver):
                arrive(frames)

        for _ in range(copies):
            delay = LATENCY_S[0] + (LATENCY_S[1] - LATENCY_S[0]) * roll()
            if roll() < self.rate:
                delay += LATE_S[0] + (LATE_S[1] - LATE_S[0]) * roll()
                self.delayed += 1
            self.world.at(delay, deliver)

    # -- the notify port ------------------------------------------------------------------

    def notify(self, sender: str, receiver: str, message: NotifyMessage) -> None:
        """Send ``message`` in upstream's wire format; the receiver gets its event."""
        frame = encode_notify(message)
        role = self.world.role_of(receiver)
        self.send(
            sender,
            receiver,
            (frame,),
            lambda frames: self._received(sender, receiver, role, frames[0]),
        )

    def _received(self, sender: str, receiver: str, role: Role, frame: bytes) -> None:
        try:
            message = decode_notify(frame, role=role)
        except WireDecodeError:
            self.undecodable += 1
            return
        self.world.deliver(receiver, event_for(message, self.world.now, source=sender))

    # -- the handshake port ---------------------------------------------------------------

    def handshake(self, consumer: str, producer: str, answered: Callable[[bool], None]) -> None:
        """D asks P for its engine metadata; ``answered(True)`` once a reply decoded."""

        def at_producer(frames: tuple[bytes, ...]) -> None:
            try:
                decode_handshake_request(frames[0])
            except WireDecodeError:
                self.undecodable += 1
                return
            engine, memory = self.fabric.descriptors(producer)
            reply = HandshakeReply(
                AgentMetadata(
                    engine_id=producer,
                    agent_metadata=engine,
                    kv_caches_base_addr=(0,),
                    num_blocks=BLOCKS,
                    block_len=BLOCK_BYTES,
                    attn_backend_name="loopback",
                ),
                {"layer.0": (memory,)},
            )
            self.send(producer, consumer, encode_handshake_reply(reply), at_consumer)

        def at_consumer(frames: tuple[bytes, ...]) -> None:
            try:
                decode_handshake_reply(*frames)
            except WireDecodeError:
                self.undecodable += 1
                answered(False)
                return
            answered(True)

        self.send(consumer, producer, (HANDSHAKE_REQUEST,), at_producer)
