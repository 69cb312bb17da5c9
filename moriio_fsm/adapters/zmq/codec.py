"""Wire codec for the control messages P and D exchange over ZeroMQ (msgpack), byte-for-byte upstream's.

The one import point of its parts: ``messages``, ``wire_limits``, ``wire_fields``, ``notify_decoder``,
``notify_encoder`` and ``handshake_codec``. Rules: a message without extension fields is upstream's bytes;
extension fields are optional, unknown keys are ignored, unknown types refused.
"""

from __future__ import annotations

from .errors import WireDecodeError, WireEncodeError
from .handshake_codec import (
    HANDSHAKE_REQUEST,
    AgentMetadata,
    HandshakeReply,
    decode_handshake_reply,
    decode_handshake_request,
    encode_handshake_reply,
)
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
from .wire_limits import DEFAULT_LIMITS, WireLimits

__all__ = [
    "AgentMetadata",
    "DEFAULT_LIMITS",
    "HANDSHAKE_REQUEST",
    "HandshakeReply",
    "Heartbeat",
    "LeaseGranted",
    "NotifyMessage",
    "Release",
    "RemoteBlocks",
    "Role",
    "WireDecodeError",
    "WireEncodeError",
    "WireForm",
    "WireLimits",
    "WriteDone",
    "WriteFailed",
    "decode_handshake_reply",
    "decode_handshake_request",
    "decode_notify",
    "encode_handshake_reply",
    "encode_notify",
]

# The wire forms, as upstream peers write them.
#
# Notify port (DEALER -> ROUTER, one frame per message):
#
#   message         wire form                                             receiver
#   remote_blocks   {req_id, transfer_id, block_notify_list, decode_rank,  producer
#                   type[, prompt_digest][, decode_dp_rank]}; older senders omit ``type``
#   write_done      {type, transfer_id[, num_writers][, producer_rank]}   consumer
#   write_failed    {type, transfer_id[, reason][, writes_stopped]        consumer
#                   [, producer_rank]}
#   release         {type, transfer_id[, consumer_tp_size]                producer
#                   [, consumer_rank]}
#   heartbeat       {type, transfer_id[, consumer_rank], seq[, reply_port]} producer
#   lease_granted   {type, transfer_id[, consumer_rank], seq, lease_s}    consumer
#   bare UTF-8 id   ``<transfer_id>`` or ``<transfer_id>:tp<rank>``:      either
#                   release on the producer, write_done on the consumer
#
# Upstream writes and reads only the fields outside brackets plus num_writers and
# consumer_tp_size. The other bracketed fields, heartbeat and lease_granted are this
# project's extension. Each field is written only when set, so a message without them
# is upstream's bytes; upstream's readers (like ours) look fields up by name and skip
# keys they do not know. Upstream refuses unknown types (so do we), so heartbeat and
# lease_granted are only ever sent to peers that run this codec.
#
# Handshake port: the request is the single frame ``b"get_meta_msg"``; the reply is two
# messages, each ``[b"", payload]``: the agent metadata map, then a map of layer name to
# packed memory descriptors.
