"""ZeroMQ control plane: wire codec, transport, peer trust policy, and the events messages become.

Rules: nothing a peer sends may crash a caller or the I/O thread; every outbound host passes
``PeerPolicy``; every error about the wire, a peer or the transport derives from ``ZmqAdapterError``.
"""

from .config import TransportConfig
from .curve import CurveConfig
from .errors import (
    HandshakeFailedError,
    TransportBusyError,
    TransportClosedError,
    UntrustedPeerError,
    WireDecodeError,
    WireEncodeError,
    ZmqAdapterError,
)
from .events import event_for
from .handshake_codec import (
    HANDSHAKE_REQUEST,
    AgentMetadata,
    HandshakeReply,
    decode_handshake_reply,
    decode_handshake_request,
    encode_handshake_reply,
)
from .hosts import default_bind_host
from .messages import (
    Heartbeat,
    LeaseGranted,
    NotifyMessage,
    Release,
    RemoteBlocks,
    Role,
    WireForm,
    WriteDone,
    WriteFailed,
)
from .notify_decoder import decode_notify
from .notify_encoder import encode_notify
from .policy import PeerPolicy, canonical_host
from .ports import RankEndpoint, listener_port
from .transport import Delivery, Peer, SendFailure, ZmqTransport
from .wire_limits import DEFAULT_LIMITS, WireLimits

__all__ = [
    "AgentMetadata",
    "CurveConfig",
    "DEFAULT_LIMITS",
    "Delivery",
    "HANDSHAKE_REQUEST",
    "HandshakeFailedError",
    "HandshakeReply",
    "Heartbeat",
    "LeaseGranted",
    "NotifyMessage",
    "Peer",
    "PeerPolicy",
    "RankEndpoint",
    "Release",
    "RemoteBlocks",
    "Role",
    "SendFailure",
    "TransportBusyError",
    "TransportClosedError",
    "TransportConfig",
    "UntrustedPeerError",
    "WireDecodeError",
    "WireEncodeError",
    "WireForm",
    "WireLimits",
    "WriteDone",
    "WriteFailed",
    "ZmqAdapterError",
    "ZmqTransport",
    "canonical_host",
    "decode_handshake_reply",
    "decode_handshake_request",
    "decode_notify",
    "default_bind_host",
    "encode_handshake_reply",
    "encode_notify",
    "event_for",
    "listener_port",
]
