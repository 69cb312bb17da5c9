"""Whose messages a transfer takes: the source its creating event binds it to.

Rules: with ``bind_peers`` a transfer takes control messages only from the host its request
named (with CURVE, only with that host's key); where none is named (P in READ mode), from the
first peer that speaks. An untrusted host binds to no sender at all, so its transfer fails by
its own timers. Looking up a name never waits (this runs on the forward thread): until the
name's first answer, the transfer takes the first sender it hears from.
"""

from __future__ import annotations

from ..adapters.zmq import ZmqTransport
from ..adapters.zmq.senders import AddressCache, expected_senders
from ..runtime.table import FIRST_SENDER
from .params import PeerAddress

#: A source no message can come from.
NOBODY = "-"


class PeerBinding:
    """The ``source`` of creating events, for the transport's trust policy and CURVE keys."""

    def __init__(self, enabled: bool, transport: ZmqTransport):
        self._enabled = enabled
        self._transport = transport
        self._addresses = AddressCache()

    def source_for(self, peer: PeerAddress | None) -> str:
        """The source a transfer with ``peer`` is created with ("" binds it to no one)."""
        if not self._enabled:
            return ""
        if peer is None:
            return FIRST_SENDER
        if not self._transport.policy.is_trusted(peer.host):
            return NOBODY
        bound = expected_senders(peer.host, self._transport.config.curve, self._addresses)
        return FIRST_SENDER if bound is None else bound
