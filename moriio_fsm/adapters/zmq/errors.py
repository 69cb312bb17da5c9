"""Errors raised by the ZeroMQ control plane.

Every failure a caller can see is one of the types below; each message names the
field, peer or setting involved and what was expected, so logs explain themselves.
"""

from __future__ import annotations

from ...errors import MoriioFsmError


class ZmqAdapterError(MoriioFsmError):
    """Base class of every error raised by ``moriio_fsm.adapters.zmq``."""


class WireDecodeError(ZmqAdapterError):
    """A control message could not be accepted.

    ``field`` names the offending field (``"<frame>"`` for the message as a whole)
    and ``reason`` says what was wrong; ``str(error)`` combines both.  This is the
    only exception the decoder lets escape, whatever bytes it is given.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class WireEncodeError(ZmqAdapterError, ValueError):
    """An outgoing message holds a value its receiver would reject.

    Raised by the encoders before anything is sent, so a bad value is reported
    to the caller that built it instead of being dropped by the peer.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class UntrustedPeerError(ZmqAdapterError):
    """An outbound connection was refused by the peer trust policy.

    Raised before any socket is created or dialled, so refusing a peer never
    touches the network.  ``host`` is the host as given, ``canonical`` its
    canonical form.
    """

    def __init__(self, host: str, canonical: str, reason: str) -> None:
        self.host = host
        self.canonical = canonical
        self.reason = reason
        super().__init__(f"peer {host!r} refused: {reason}")


class TransportClosedError(ZmqAdapterError):
    """The transport was closed; no more messages can be sent or handshakes made."""


class TransportBusyError(ZmqAdapterError):
    """The transport refused new work because one of its bounds was reached.

    Nothing was queued; the message names the bound (a ``TransportConfig``
    setting) so the caller can retry later or raise it.
    """


class HandshakeFailedError(ZmqAdapterError):
    """A handshake got no valid reply in time (timeout, bad reply, closed transport)."""
