"""The notify listener's receiving side: who sent each frame, decoding it, handing it on.

Rules: runs on the I/O thread only; a bad frame is counted, logged (rate-limited) and dropped,
and an ``on_message`` callback that raises is counted and logged; neither stops the listener.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import zmq

from ...logs import get_logger
from .config import TransportConfig
from .errors import WireDecodeError
from .messages import NotifyMessage
from .notify_decoder import decode_notify
from .policy import canonical_host
from .reporting import LogLimiter, TransportCounts
from .senders import sender_name

__all__ = ["Delivery", "NotifyReceiver", "Peer"]

log = get_logger("moriio_fsm.adapters.zmq")


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a message: the ROUTER identity of its connection, when known its IP address,
    and with CURVE the public key it authenticated with (hex).

    ``source`` names the connection: the sender (``sender_name``: the canonical host, and
    ``/`` and the key with CURVE), ``#``, the identity in hex (``"127.0.0.1#0080000001"``);
    the host is ``unknown`` when libzmq did not say.
    """

    identity: bytes
    address: str | None
    key: str | None = None
    # Derived once per (identity, address, key), not once per message.
    source: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sender = sender_name(_source_host(self.address), self.key)
        object.__setattr__(self, "source", f"{sender}#{self.identity.hex()}")


def _source_host(address: str | None) -> str:
    if not address:
        return "unknown"
    try:
        return str(canonical_host(address))
    except ValueError:
        return address  # not an IP literal: keep libzmq's text rather than lose the host


def _frame_property(frame: zmq.Frame, name: str) -> str | None:
    """A metadata property of ``frame``, or None where its socket does not have it.

    libzmq gives every named property as text; pyzmq's ``get`` is typed for its integer
    options too, hence the check."""
    try:
        value = frame.get(name)
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) else None


def _ipv4_if_mapped(address: str | None) -> str | None:
    """A dual-stack socket names an IPv4 peer ``::ffff:a.b.c.d``: report it as IPv4. Parsed
    once per new peer, not per message (the cache above is keyed on libzmq's text)."""
    if address and address.startswith("::ffff:"):
        mapped = ipaddress.IPv6Address(address).ipv4_mapped
        return str(mapped) if mapped is not None else address
    return address


class Delivery(NamedTuple):
    """One accepted message, handed to the ``on_message`` callback.

    A named tuple rather than a dataclass: one is built per message on the
    listener's hot path.  The transport delivers messages, not events: turn one
    into the machines' event with ``events.event_for(message, received_at, source)``.
    """

    message: NotifyMessage
    peer: Peer
    received_at: float  # time.monotonic() when it was decoded

    @property
    def source(self) -> str:
        """The sending connection (``Peer.source``): the same for every message over one
        connection, different for two connections."""
        return self.peer.source


class NotifyReceiver:
    """Reads the listener socket's messages in batches: each frame decoded for this rank's role
    and limits, named by its ``Peer``, and delivered to ``deliver`` or rejected."""

    def __init__(
        self,
        config: TransportConfig,
        counts: TransportCounts,
        log_limiter: LogLimiter,
        deliver: Callable[[Delivery], None],
    ) -> None:
        self.config = config
        self.counts = counts
        self._log_limiter = log_limiter
        self._deliver = deliver
        self._peers: dict[tuple, Peer] = {}

    def peer_for(self, identity: bytes, frame: zmq.Frame) -> Peer:
        """Who sent ``frame``: read from the frame itself every time, since a peer picks its
        own routing identity and may take one a closed connection used; the ``Peer`` is
        cached per (identity, address, key) only to keep its ``source`` text."""
        address = _frame_property(frame, "Peer-Address")
        # The ZAP handler's answer: the CURVE key in hex; none without authentication.
        key = _frame_property(frame, "User-Id") or None
        cache_key = (identity, address, key)
        peers = self._peers
        peer = peers.get(cache_key)
        if peer is None:
            peer = Peer(identity, _ipv4_if_mapped(address), key)
            if len(peers) >= 4096:
                peers.pop(next(iter(peers)))  # oldest first
            peers[cache_key] = peer
        return peer

    def drain(self, sock: zmq.Socket) -> None:
        """Take up to ``max_batch`` messages waiting on the listener ``sock``."""
        recv = sock.recv
        cfg = self.config
        role, limits, deliver = cfg.role, cfg.limits, self._deliver
        counts, monotonic = self.counts, time.monotonic
        for _ in range(cfg.max_batch):
            try:
                identity = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            counts.received += 1
            try:
                # The rest of a multipart message is already here (all or nothing).
                frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.reject(Peer(identity, None), WireDecodeError("<frame>", "no payload frame"))
                continue
            peer = self.peer_for(identity, frame)
            if frame.more:
                extra = 0
                while sock.getsockopt(zmq.RCVMORE):
                    recv(zmq.NOBLOCK, copy=False)
                    extra += 1
                self.reject(
                    peer, WireDecodeError("<frame>", f"expected one frame, got {extra + 1}")
                )
                continue
            try:
                message = decode_notify(frame.bytes, role=role, limits=limits)
            except WireDecodeError as exc:
                self.reject(peer, exc)
                continue
            try:
                deliver(Delivery(message, peer, monotonic()))
            except Exception:
                counts.callback_errors += 1
                log.exception(
                    "zmq.on_message_raised", peer=peer.address, transfer_id=message.transfer_id
                )
            else:
                counts.delivered += 1

    def reject(self, peer: Peer, error: WireDecodeError) -> None:
        """Count and log (rate-limited) a message refused from ``peer``."""
        self.counts.rejected += 1
        if self._log_limiter.allow(time.monotonic()):
            log.warning(
                "zmq.message_rejected",
                peer=peer.address,
                identity=peer.identity.hex(),
                field=error.field,
                reason=error.reason,
            )
