"""The notify port's messages as typed values: who receives each, and which wire form it takes.

Rules: messages are frozen and hold only wire fields; extension fields are keyword-only and
default to None (not sent); the wire forms themselves are listed below the imports.
"""

from __future__ import annotations

import enum
import re
from dataclasses import KW_ONLY, dataclass, field

__all__ = [
    "BARE_RANK",
    "RECEIVER",
    "BlockIds",
    "Heartbeat",
    "LeaseGranted",
    "NotifyMessage",
    "Release",
    "RemoteBlocks",
    "Role",
    "WireForm",
    "WriteDone",
    "WriteFailed",
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


class Role(enum.Enum):
    """Which side a listener serves; decides what it may receive."""

    PRODUCER = "producer"  # prefill (P): receives remote_blocks and release
    CONSUMER = "consumer"  # decode (D): receives write_done and write_failed


class WireForm(enum.Enum):
    """Which of upstream's encodings a message arrived in (and is written back in)."""

    TYPED = "typed"  # a msgpack map with a ``type`` field: today's form
    UNTYPED = "untyped"  # a remote_blocks map without ``type``: older senders
    BARE_ID = "bare_id"  # the transfer id as plain UTF-8: the oldest form


# The bare-id form's ``<transfer_id>:tp<rank>``: a release naming its sender's TP rank.
BARE_RANK = re.compile(r"^(.+):tp([0-9]{1,5})$")

BlockIds = tuple[int, ...] | tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """D tells P where its blocks are (WRITE mode), so P can write into them.

    ``block_ids`` is flat, or one tuple per KV cache group when ``per_group``.
    ``prompt_digest`` (extension): D's fingerprint of the prompt the blocks are for, so that
    P writes only its own prompt's KV into them (lower-case hex). ``decode_dp_rank``
    (extension): the data-parallel rank of the D engine that allocated them.
    """

    transfer_id: str
    req_id: str
    block_ids: BlockIds
    decode_rank: int = 0
    form: WireForm = field(default=WireForm.TYPED, compare=False)
    _: KW_ONLY
    prompt_digest: str | None = None
    decode_dp_rank: int | None = None

    kind = "remote_blocks"

    @property
    def per_group(self) -> bool:
        return bool(self.block_ids) and isinstance(self.block_ids[0], tuple)


# Extension fields of upstream's messages are keyword-only, after ``form``, so every
# positional construction written against upstream's fields keeps its meaning.


@dataclass(frozen=True, slots=True)
class WriteDone:
    """P tells D that every write of one writer landed.

    ``num_writers`` is how many P ranks write into this D rank; absent on the
    wire means one. ``producer_rank`` (extension) names the P rank that sends it.
    """

    transfer_id: str
    num_writers: int | None = None
    form: WireForm = field(default=WireForm.TYPED, compare=False)
    _: KW_ONLY
    producer_rank: int | None = None

    kind = "write_done"


@dataclass(frozen=True, slots=True)
class WriteFailed:
    """P tells D it gave up on the transfer, so D stops waiting for it.

    Extension fields: ``reason`` (short, printable), ``writes_stopped`` (whether no
    write of P's can still land; absent means True, see ``events.py``) and
    ``producer_rank`` (the P rank that sends it).
    """

    transfer_id: str
    form: WireForm = field(default=WireForm.TYPED, compare=False)
    _: KW_ONLY
    reason: str | None = None
    writes_stopped: bool | None = None
    producer_rank: int | None = None

    kind = "write_failed"


@dataclass(frozen=True, slots=True)
class Release:
    """D tells P it no longer needs P's blocks for the transfer.

    ``consumer_tp_size`` is how many D ranks will send a release (absent means
    one); ``sender_tp_rank`` is set only by the bare ``<id>:tp<rank>`` form;
    ``consumer_rank`` (extension) is the sending D rank in the typed form.
    """

    transfer_id: str
    consumer_tp_size: int | None = None
    sender_tp_rank: int | None = None
    form: WireForm = field(default=WireForm.TYPED, compare=False)
    _: KW_ONLY
    consumer_rank: int | None = None

    kind = "release"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """D asks P to keep its blocks (READ mode): renews the lease (extension).

    ``seq`` numbers the heartbeats of one D rank so that the grant can be matched
    to it; ``consumer_rank`` is the sending D rank (absent: unknown); ``reply_port`` the
    port D's listener answers on (P replies to the sender's address at that port).
    """

    transfer_id: str
    seq: int
    consumer_rank: int | None = None
    form: WireForm = field(default=WireForm.TYPED, compare=False)  # only ever TYPED
    _: KW_ONLY
    reply_port: int | None = None

    kind = "heartbeat"


@dataclass(frozen=True, slots=True)
class LeaseGranted:
    """P tells a D rank it holds the blocks for ``lease_s`` more seconds (extension).

    ``seq`` is the heartbeat it answers; ``consumer_rank`` the D rank it answers.
    """

    transfer_id: str
    seq: int
    lease_s: float
    consumer_rank: int | None = None
    form: WireForm = field(default=WireForm.TYPED, compare=False)  # only ever TYPED

    kind = "lease_granted"


# A message's ``kind`` is its wire ``type``; which runtime event it becomes is decided
# in ``events.py``, so the wire format never depends on the machines' event names.
NotifyMessage = RemoteBlocks | WriteDone | WriteFailed | Release | Heartbeat | LeaseGranted

# The side each message type is sent to: a listener refuses the other side's.
RECEIVER: dict[str, Role] = {
    "remote_blocks": Role.PRODUCER,
    "release": Role.PRODUCER,
    "heartbeat": Role.PRODUCER,
    "write_done": Role.CONSUMER,
    "write_failed": Role.CONSUMER,
    "lease_granted": Role.CONSUMER,
}
