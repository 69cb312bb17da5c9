"""Wire codec for the control messages P and D exchange over ZeroMQ (msgpack), byte-for-byte upstream's.

Rules: only ``WireDecodeError`` (naming field and reason) escapes the decoder; sizes are capped by msgpack's
unpacker limits, tightened per frame to what its bytes can hold; the encoder writes upstream's bytes exactly
when no extension field is set. Extension fields are optional, unknown keys are ignored, unknown types refused.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import KW_ONLY, dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Union

import msgpack

from .errors import WireDecodeError, ZmqAdapterError

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
HANDSHAKE_REQUEST = b"get_meta_msg"
_WHOLE = "<frame>"


class WireEncodeError(ZmqAdapterError, ValueError):
    """An outgoing message holds a value its receiver would reject.

    Raised by the encoders before anything is sent, so a bad value is reported
    to the caller that built it instead of being dropped by the peer.
    """

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class Role(enum.Enum):
    """Which side a listener serves; decides what it may receive."""

    PRODUCER = "producer"  # prefill (P): receives remote_blocks and release
    CONSUMER = "consumer"  # decode (D): receives write_done and write_failed


class WireForm(enum.Enum):
    """Which of upstream's encodings a message arrived in (and is written back in)."""

    TYPED = "typed"  # a msgpack map with a ``type`` field: today's form
    UNTYPED = "untyped"  # a remote_blocks map without ``type``: older senders
    BARE_ID = "bare_id"  # the transfer id as plain UTF-8: the oldest form


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Upper bounds applied to every received message; all are inclusive.

    The defaults fit a 128k-token prompt in 16-token blocks with room to spare;
    anything beyond them is rejected, never buffered.
    """

    max_message_bytes: int = 4 << 20
    max_id_length: int = 512
    max_blocks: int = 1 << 17  # block ids in one message, all groups together
    max_groups: int = 64
    max_block_id: int = (1 << 31) - 1
    max_rank: int = 65_535
    max_count: int = 65_536  # num_writers, consumer_tp_size
    max_map_entries: int = 64
    max_reason_length: int = 64  # write_failed's reason, in characters
    max_seq: int = (1 << 63) - 1  # heartbeat and lease_granted sequence numbers (msgpack int64)
    max_lease_s: float = 86_400.0  # a lease longer than a day is a bug, not a lease
    max_handshake_bytes: int = 64 << 20
    max_layers: int = 4_096
    max_descriptors_per_layer: int = 64
    max_blob_bytes: int = 1 << 20  # one packed engine or memory descriptor

    # Derived once: the unpacker options are needed for every received message.
    _notify_options: dict = field(init=False, repr=False, compare=False)
    _handshake_options: dict = field(init=False, repr=False, compare=False)
    # Per-frame notify options for small frames, by frame size (at most
    # _PREPASS_FROM_BYTES + 1 entries): most messages are a few dozen bytes.
    _notify_small: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "max_message_bytes", "max_id_length", "max_blocks", "max_groups", "max_block_id",
            "max_rank", "max_count", "max_map_entries", "max_handshake_bytes", "max_layers",
            "max_descriptors_per_layer", "max_blob_bytes", "max_reason_length", "max_seq",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        lease = self.max_lease_s
        if type(lease) not in (int, float) or not math.isfinite(lease) or lease <= 0:
            raise ValueError(f"max_lease_s: expected a positive finite number of seconds, got {lease!r}")
        # UTF-8 needs at most 4 bytes a character; the longest string is an id or a reason.
        text_bytes = 4 * max(self.max_id_length, self.max_reason_length)
        notify = {
            "raw": False,
            "use_list": False,
            "strict_map_key": True,
            "max_str_len": text_bytes,
            "max_bin_len": text_bytes,
            "max_array_len": max(self.max_blocks, self.max_groups),
            "max_map_len": self.max_map_entries,
            "max_ext_len": 0,
        }
        handshake = {
            "raw": False,
            "use_list": False,
            "strict_map_key": True,
            "max_str_len": max(text_bytes, 4096),
            "max_bin_len": self.max_blob_bytes,
            "max_array_len": max(self.max_layers, self.max_descriptors_per_layer),
            "max_map_len": max(self.max_layers, self.max_map_entries),
            "max_ext_len": 0,
        }
        object.__setattr__(self, "_notify_options", notify)
        object.__setattr__(self, "_handshake_options", handshake)
        object.__setattr__(self, "_notify_small", {})

    def notify_unpack_options(self, frame_size: int | None = None) -> dict[str, Any]:
        """msgpack unpacker options for a notify frame (of ``frame_size`` bytes, if given)."""
        if frame_size is None:
            return dict(self._notify_options)
        return _per_frame(self._notify_options, frame_size)

    def handshake_unpack_options(self, frame_size: int | None = None) -> dict[str, Any]:
        """msgpack unpacker options for a handshake payload (of ``frame_size`` bytes, if given)."""
        if frame_size is None:
            return dict(self._handshake_options)
        return _per_frame(self._handshake_options, frame_size)


# Frames up to this size are unpacked without the completeness pre-pass: even
# nested lying headers cost them at most (size / 3) * size * 8 bytes (~170 KB).
_PREPASS_FROM_BYTES = 256


def _unpack_bounded(frame: bytes, options: dict, small: dict | None = None) -> Any:
    """``msgpack.unpackb`` whose allocations are bounded by the frame's size.

    Per-frame limits stop any single header from claiming more entries than the
    frame can hold, but nested headers each below that bound still add up (a
    5 KB frame of array headers nested 1000 deep asks for 40 MB).  So a larger
    frame is first skipped through without building anything, which proves its
    first object complete; in a complete object every declared entry is present
    and takes at least one byte, so what is then allocated is O(frame size).
    ``small`` caches the per-frame options of small frames by size.
    """
    size = len(frame)
    if size <= _PREPASS_FROM_BYTES and small is not None:
        tight = small.get(size)
        if tight is None:
            tight = small[size] = _per_frame(options, size)
        return msgpack.unpackb(frame, **tight)
    if size > _PREPASS_FROM_BYTES:
        scan = msgpack.Unpacker(max_buffer_size=size)
        scan.feed(frame)
        try:
            scan.skip()  # allocates nothing
        except msgpack.OutOfData:
            raise ValueError("incomplete: a length declared in the frame runs past its end") from None
    return msgpack.unpackb(frame, **_per_frame(options, size))


def _per_frame(options: dict, size: int) -> dict:
    """Tighten the unpacker limits to what a frame of ``size`` bytes can really hold.

    msgpack allocates an array, map or string as soon as it reads its header, so a
    header declaring 100k entries costs 800 KB even in a 14-byte frame; nested
    headers multiply that.  Every array entry takes at least one byte, every map
    entry two, and a string or binary value its own length, so lengths beyond
    these are lies and are refused before anything is allocated.
    """
    tight = dict(options)
    tight["max_str_len"] = min(options["max_str_len"], size)
    tight["max_bin_len"] = min(options["max_bin_len"], size)
    tight["max_array_len"] = min(options["max_array_len"], size)
    tight["max_map_len"] = min(options["max_map_len"], size // 2)
    return tight


DEFAULT_LIMITS = WireLimits()

BlockIds = Union[tuple[int, ...], tuple[tuple[int, ...], ...]]


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
NotifyMessage = Union[RemoteBlocks, WriteDone, WriteFailed, Release, Heartbeat, LeaseGranted]

_RECEIVER: dict[str, Role] = {
    "remote_blocks": Role.PRODUCER,
    "release": Role.PRODUCER,
    "heartbeat": Role.PRODUCER,
    "write_done": Role.CONSUMER,
    "write_failed": Role.CONSUMER,
    "lease_granted": Role.CONSUMER,
}


# ---------------------------------------------------------------------------
# field validation (shared by the decoder and the encoder)
# ---------------------------------------------------------------------------


def _type_name(value: object) -> str:
    return type(value).__name__


def _check_id(value: object, name: str, limits: WireLimits, error: type) -> str:
    if type(value) is not str:
        raise error(name, f"expected a string, got {_type_name(value)}")
    if not value:
        raise error(name, "must not be empty")
    if len(value) > limits.max_id_length:
        raise error(name, f"{len(value)} characters exceeds the limit of {limits.max_id_length}")
    # Ids end up in logs and maps: no control characters or spaces.
    if not value.isprintable() or " " in value:
        raise error(name, "must contain only printable characters and no whitespace")
    return value


def _check_int(value: object, name: str, low: int, high: int, error: type) -> int:
    if type(value) is not int:  # excludes bool, which msgpack maps to True/False
        raise error(name, f"expected an integer, got {_type_name(value)}")
    if value < low or value > high:
        raise error(name, f"{value} is out of range [{low}, {high}]")
    return value


def _check_reason(value: object, name: str, limits: WireLimits, error: type) -> str:
    if type(value) is not str:
        raise error(name, f"expected a string, got {_type_name(value)}")
    if not value:
        raise error(name, "must not be empty (leave the field out instead)")
    if len(value) > limits.max_reason_length:
        raise error(name, f"{len(value)} characters exceeds the limit of {limits.max_reason_length}")
    # A reason ends up in logs: spaces are fine, control characters are not.
    if not value.isprintable():
        raise error(name, "must contain only printable characters")
    return value


def _check_bool(value: object, name: str, error: type) -> bool:
    if type(value) is not bool:  # 0 and 1 are integers, not verdicts
        raise error(name, f"expected a boolean, got {_type_name(value)}")
    return value


def _check_seconds(value: object, name: str, high: float, error: type) -> float:
    # Whole seconds may arrive as a msgpack integer; bool is refused (it is an int in Python).
    if type(value) is not float and type(value) is not int:
        raise error(name, f"expected a number of seconds, got {_type_name(value)}")
    if type(value) is float and not math.isfinite(value):
        raise error(name, f"expected a finite number of seconds, got {value!r}")
    if value < 0 or value > high:  # compared before float(): a huge int must not overflow
        raise error(name, f"{value!r} is out of range [0, {high!r}]")
    return float(value) + 0.0  # + 0.0 turns -0.0 into 0.0


def _check_block_list(
    value: object, name: str, limits: WireLimits, error: type
) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise error(name, f"expected a list of block ids, got {_type_name(value)}")
    if len(value) > limits.max_blocks:
        raise error(name, f"{len(value)} block ids exceeds the limit of {limits.max_blocks}")
    items = tuple(value)
    # Fast path first; the slow loop only runs to name the offending index.
    if all(type(b) is int for b in items) and (
        not items or (min(items) >= 0 and max(items) <= limits.max_block_id)
    ):
        return items
    for index, block in enumerate(items):
        _check_int(block, f"{name}[{index}]", 0, limits.max_block_id, error)
    raise AssertionError("unreachable: a bad block id was not found")  # pragma: no cover


def _check_blocks(value: object, name: str, limits: WireLimits, error: type) -> BlockIds:
    if not isinstance(value, (tuple, list)):
        raise error(name, f"expected a list of block ids or of per-group lists, got {_type_name(value)}")
    if not value:
        raise error(name, "must not be empty")
    if not isinstance(value[0], (tuple, list)):
        return _check_block_list(value, name, limits, error)
    if len(value) > limits.max_groups:
        raise error(name, f"{len(value)} KV cache groups exceeds the limit of {limits.max_groups}")
    groups = []
    total = 0
    for index, group in enumerate(value):
        if not isinstance(group, (tuple, list)):
            raise error(
                f"{name}[{index}]",
                f"expected a list of block ids (the first entry was a group), got {_type_name(group)}",
            )
        checked = _check_block_list(group, f"{name}[{index}]", limits, error)
        total += len(checked)
        groups.append(checked)
    if total == 0:
        raise error(name, "every KV cache group is empty")
    if total > limits.max_blocks:
        raise error(name, f"{total} block ids in all groups exceeds the limit of {limits.max_blocks}")
    return tuple(groups)


# ---------------------------------------------------------------------------
# notify decoding
# ---------------------------------------------------------------------------

_packb = msgpack.packb  # upstream's msgpack.dumps with default options (use_bin_type=True)
_MAP_MARKERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}
_BARE_RANK = re.compile(r"^(.+):tp([0-9]{1,5})$")


def decode_notify(
    frame: bytes | bytearray | memoryview,
    *,
    role: Role | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
) -> NotifyMessage:
    """Decode one notify-port frame into a typed message.

    ``role`` is the receiving side: messages meant for the other side are
    rejected, and a bare id is read as ``Release`` (producer) or ``WriteDone``
    (consumer).  Without a role every structured message is accepted and a bare
    id is rejected as ambiguous.

    Keys a message does not define are ignored (a newer peer may add some); an
    unknown ``type`` is refused. Raises ``WireDecodeError`` (and nothing else)
    for any frame that is not a valid message within ``limits``.
    """
    try:
        if type(frame) is not bytes:
            if not isinstance(frame, (bytes, bytearray, memoryview)):
                raise WireDecodeError(_WHOLE, f"expected bytes, got {_type_name(frame)}")
            frame = bytes(frame)
        size = len(frame)
        if size == 0:
            raise WireDecodeError(_WHOLE, "empty message")
        if size > limits.max_message_bytes:
            raise WireDecodeError(_WHOLE, f"{size} bytes exceeds the limit of {limits.max_message_bytes}")
        if frame[0] not in _MAP_MARKERS:
            # Not a msgpack map, so not a structured message: upstream reads it as a
            # bare id (a one-character id such as "7" is also a msgpack integer).
            # It is never unpacked, so array headers in it allocate nothing.
            return _decode_bare(frame, role, limits)
        try:
            data = _unpack_bounded(frame, limits._notify_options, limits._notify_small)
        except Exception as exc:  # msgpack raises ValueError subclasses and TypeError
            raise WireDecodeError(_WHOLE, f"invalid msgpack map ({_type_name(exc)}: {exc})") from None
        return _decode_structured(data, role, limits)
    except WireDecodeError:
        raise
    except Exception as exc:  # defence in depth: a validator bug must not kill a listener
        raise WireDecodeError(_WHOLE, f"undecodable ({_type_name(exc)}: {exc})") from exc


def _decode_bare(frame: bytes, role: Role | None, limits: WireLimits) -> NotifyMessage:
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        raise WireDecodeError(_WHOLE, "neither a msgpack map nor a UTF-8 transfer id") from None
    if role is None:
        raise WireDecodeError(_WHOLE, "a bare transfer id needs the receiver's role (producer or consumer)")
    if role is Role.CONSUMER:
        return WriteDone(_check_id(text, "transfer_id", limits, WireDecodeError), None, WireForm.BARE_ID)
    rank: int | None = None
    match = _BARE_RANK.match(text)
    if match is not None:
        text, rank = match.group(1), int(match.group(2))
        _check_int(rank, "transfer_id (tp rank suffix)", 0, limits.max_rank, WireDecodeError)
    transfer_id = _check_id(text, "transfer_id", limits, WireDecodeError)
    return Release(transfer_id, None, rank, WireForm.BARE_ID)


def _optional_count(data: dict, name: str, limits: WireLimits) -> int | None:
    value = data.get(name)
    if value is None or (type(value) is int and 1 <= value <= limits.max_count):
        return value
    return _check_int(value, name, 1, limits.max_count, WireDecodeError)  # raises with the reason


def _optional_rank(data: dict, name: str, limits: WireLimits) -> int | None:
    # Absent (or nil) means the sender did not say; -1 is never written for that.
    value = data.get(name)
    if value is None:
        return None
    return _check_int(value, name, 0, limits.max_rank, WireDecodeError)


def _required_seq(data: dict, limits: WireLimits) -> int:
    if "seq" not in data:
        raise WireDecodeError("seq", "missing")
    return _check_int(data["seq"], "seq", 0, limits.max_seq, WireDecodeError)


def _decode_write_done(data: dict, transfer_id: str, limits: WireLimits, form: WireForm) -> NotifyMessage:
    writers = _optional_count(data, "num_writers", limits)
    rank = data.get("producer_rank")
    if rank is None:  # upstream's form: the hot path, one lookup
        return WriteDone(transfer_id, writers, form)
    return WriteDone(transfer_id, writers, form, producer_rank=_optional_rank(data, "producer_rank", limits))


def _decode_write_failed(data: dict, transfer_id: str, limits: WireLimits, form: WireForm) -> NotifyMessage:
    reason = data.get("reason")
    if reason is not None:
        reason = _check_reason(reason, "reason", limits, WireDecodeError)
    stopped = data.get("writes_stopped")
    if stopped is not None:
        stopped = _check_bool(stopped, "writes_stopped", WireDecodeError)
    return WriteFailed(transfer_id, form, reason=reason, writes_stopped=stopped,
                       producer_rank=_optional_rank(data, "producer_rank", limits))


def _decode_release(data: dict, transfer_id: str, limits: WireLimits, form: WireForm) -> NotifyMessage:
    return Release(transfer_id, _optional_count(data, "consumer_tp_size", limits), None, form,
                   consumer_rank=_optional_rank(data, "consumer_rank", limits))


def _decode_heartbeat(data: dict, transfer_id: str, limits: WireLimits, form: WireForm) -> NotifyMessage:
    port = data.get("reply_port")
    if port is not None:
        port = _check_int(port, "reply_port", 1, 65535, WireDecodeError)
    return Heartbeat(transfer_id, _required_seq(data, limits), _optional_rank(data, "consumer_rank", limits),
                     reply_port=port)


def _decode_lease_granted(data: dict, transfer_id: str, limits: WireLimits, form: WireForm) -> NotifyMessage:
    seq = _required_seq(data, limits)
    if "lease_s" not in data:
        raise WireDecodeError("lease_s", "missing")
    lease = _check_seconds(data["lease_s"], "lease_s", limits.max_lease_s, WireDecodeError)
    return LeaseGranted(transfer_id, seq, lease, _optional_rank(data, "consumer_rank", limits))


def _decode_remote_blocks(data: dict, transfer_id: str, limits: WireLimits, form: WireForm) -> NotifyMessage:
    if "req_id" not in data:
        raise WireDecodeError("req_id", "missing")
    req_id = _check_id(data["req_id"], "req_id", limits, WireDecodeError)
    if "block_notify_list" not in data:
        raise WireDecodeError("block_notify_list", "missing")
    blocks = _check_blocks(data["block_notify_list"], "block_notify_list", limits, WireDecodeError)
    # Upstream readers default a missing decode_rank to 0; keep that leniency.
    rank = data.get("decode_rank", 0)
    _check_int(rank, "decode_rank", 0, limits.max_rank, WireDecodeError)
    digest = data.get("prompt_digest")
    if digest is not None:
        digest = _check_digest(digest, "prompt_digest", WireDecodeError)
    dp_rank = data.get("decode_dp_rank")
    if dp_rank is not None:
        _check_int(dp_rank, "decode_dp_rank", 0, limits.max_rank, WireDecodeError)
    return RemoteBlocks(transfer_id, req_id, blocks, rank, form, prompt_digest=digest,
                        decode_dp_rank=dp_rank)


def _check_digest(value: object, name: str, error: type) -> str:
    if type(value) is not str:
        raise error(name, f"expected a string, got {_type_name(value)}")
    if not 0 < len(value) <= 64 or value.strip("0123456789abcdef"):
        raise error(name, "expected 1-64 lower-case hex digits")
    return value


_DECODERS = {
    "remote_blocks": _decode_remote_blocks,
    "release": _decode_release,
    "write_done": _decode_write_done,
    "write_failed": _decode_write_failed,
    "heartbeat": _decode_heartbeat,
    "lease_granted": _decode_lease_granted,
}


def _decode_structured(data: dict, role: Role | None, limits: WireLimits) -> NotifyMessage:
    kind = data.get("type")
    form = WireForm.TYPED
    if kind is None:
        if "req_id" not in data:
            raise WireDecodeError("type", "missing (and no req_id to mark an older remote_blocks)")
        kind, form = "remote_blocks", WireForm.UNTYPED
    elif type(kind) is not str:
        raise WireDecodeError("type", f"expected a string, got {_type_name(kind)}")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        expected = ", ".join(sorted(_DECODERS))
        raise WireDecodeError("type", f"unknown message type {kind[:64]!r}; expected one of {expected}")
    if role is not None and _RECEIVER[kind] is not role:
        raise WireDecodeError(
            "type", f"{kind!r} is meant for the {_RECEIVER[kind].value}, but this listener is the {role.value}"
        )
    transfer_id = data.get("transfer_id")
    if transfer_id is None:
        raise WireDecodeError("transfer_id", "missing")
    _check_id(transfer_id, "transfer_id", limits, WireDecodeError)
    return decoder(data, transfer_id, limits, form)


# ---------------------------------------------------------------------------
# notify encoding
# ---------------------------------------------------------------------------


def encode_notify(message: NotifyMessage, *, limits: WireLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``message`` in upstream's wire format, in the form it names.

    Raises ``WireEncodeError`` if a field holds a value the receiver would reject.
    """
    transfer_id = _check_id(message.transfer_id, "transfer_id", limits, WireEncodeError)
    form = message.form
    # Keys are added in upstream's order, extension keys last and only when set: a
    # message without extension fields is upstream's bytes exactly.
    if type(message) is WriteDone:
        rank = message.producer_rank
        if form is WireForm.BARE_ID:
            if rank is not None:
                raise WireEncodeError("producer_rank", "the bare-id form cannot carry it; send the typed form")
            return transfer_id.encode("utf-8")
        writers = message.num_writers
        if rank is None:
            if writers is None:
                return _packb({"type": "write_done", "transfer_id": transfer_id})
            if type(writers) is not int or not 1 <= writers <= limits.max_count:
                _check_int(writers, "num_writers", 1, limits.max_count, WireEncodeError)
            return _packb({"type": "write_done", "transfer_id": transfer_id, "num_writers": writers})
        payload = {"type": "write_done", "transfer_id": transfer_id}
        if writers is not None:
            payload["num_writers"] = _check_int(writers, "num_writers", 1, limits.max_count, WireEncodeError)
        payload["producer_rank"] = _encode_rank(rank, "producer_rank", limits)
        return _packb(payload)
    if type(message) is WriteFailed:
        payload = {"type": "write_failed", "transfer_id": transfer_id}
        if message.reason is not None:
            payload["reason"] = _check_reason(message.reason, "reason", limits, WireEncodeError)
        if message.writes_stopped is not None:
            payload["writes_stopped"] = _check_bool(message.writes_stopped, "writes_stopped", WireEncodeError)
        if message.producer_rank is not None:
            payload["producer_rank"] = _encode_rank(message.producer_rank, "producer_rank", limits)
        return _packb(payload)
    if type(message) is Release:
        if form is WireForm.BARE_ID:
            if message.consumer_rank is not None:
                raise WireEncodeError(
                    "consumer_rank", "the bare-id form cannot carry it; set sender_tp_rank or send the typed form"
                )
            if message.sender_tp_rank is None:
                if _BARE_RANK.match(transfer_id) is not None:
                    raise WireEncodeError(
                        "transfer_id",
                        f"{transfer_id[:64]!r} ends in ':tp<rank>', which the bare form reads as a "
                        "sender rank; send it typed or set sender_tp_rank",
                    )
                return transfer_id.encode("utf-8")
            rank = _check_int(message.sender_tp_rank, "sender_tp_rank", 0, limits.max_rank, WireEncodeError)
            return f"{transfer_id}:tp{rank}".encode("utf-8")
        payload = {"type": "release", "transfer_id": transfer_id}
        if message.consumer_tp_size is not None:
            payload["consumer_tp_size"] = _check_int(
                message.consumer_tp_size, "consumer_tp_size", 1, limits.max_count, WireEncodeError
            )
        if message.consumer_rank is not None:
            payload["consumer_rank"] = _encode_rank(message.consumer_rank, "consumer_rank", limits)
        return _packb(payload)
    if type(message) is Heartbeat or type(message) is LeaseGranted:
        if form is not WireForm.TYPED:
            raise WireEncodeError("form", f"{message.kind} has only the typed form, got {form}")
        payload = {"type": message.kind, "transfer_id": transfer_id}
        if message.consumer_rank is not None:
            payload["consumer_rank"] = _encode_rank(message.consumer_rank, "consumer_rank", limits)
        payload["seq"] = _check_int(message.seq, "seq", 0, limits.max_seq, WireEncodeError)
        if type(message) is LeaseGranted:
            payload["lease_s"] = _check_seconds(message.lease_s, "lease_s", limits.max_lease_s, WireEncodeError)
        elif message.reply_port is not None:
            payload["reply_port"] = _check_int(message.reply_port, "reply_port", 1, 65535, WireEncodeError)
        return _packb(payload)
    if type(message) is RemoteBlocks:
        payload = {
            "req_id": _check_id(message.req_id, "req_id", limits, WireEncodeError),
            "transfer_id": transfer_id,
            "block_notify_list": _check_blocks(
                message.block_ids, "block_notify_list", limits, WireEncodeError
            ),
            "decode_rank": _check_int(message.decode_rank, "decode_rank", 0, limits.max_rank, WireEncodeError),
        }
        if message.prompt_digest is not None:
            payload["prompt_digest"] = _check_digest(message.prompt_digest, "prompt_digest",
                                                     WireEncodeError)
        if message.decode_dp_rank is not None:
            payload["decode_dp_rank"] = _check_int(message.decode_dp_rank, "decode_dp_rank", 0,
                                                   limits.max_rank, WireEncodeError)
        if form is not WireForm.UNTYPED:
            payload["type"] = "remote_blocks"
        return msgpack.packb(payload)
    raise WireEncodeError("<message>", f"not a notify message: {_type_name(message)}")


def _encode_rank(value: object, name: str, limits: WireLimits) -> int:
    # None, not -1, says "unknown": the wire has one spelling for it (the field left out).
    if value == -1 and type(value) is int:
        raise WireEncodeError(name, "-1 is not a rank; leave the field as None when the rank is unknown")
    return _check_int(value, name, 0, limits.max_rank, WireEncodeError)


# ---------------------------------------------------------------------------
# handshake
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentMetadata:
    """What a peer needs to reach this engine's KV cache over RDMA."""

    engine_id: str
    agent_metadata: bytes  # packed mori engine descriptor
    kv_caches_base_addr: tuple[int, ...]
    num_blocks: int
    block_len: int
    attn_backend_name: str
    #: Extension: what the KV cache holds (layout, dtype, block_size, num_kv_heads,
    #: head_size ...), so two peers whose caches differ are refused at the handshake.
    kv_format: Mapping[str, str | int] | None = None


@dataclass(frozen=True, slots=True)
class HandshakeReply:
    """The two-part handshake answer: agent metadata and per-layer memory descriptors."""

    metadata: AgentMetadata
    layer_memory: Mapping[str, tuple[bytes, ...]]


_METADATA_FIELDS = (
    "engine_id",
    "agent_metadata",
    "kv_caches_base_addr",
    "num_blocks",
    "block_len",
    "attn_backend_name",
)
_MAX_U64 = (1 << 64) - 1


def decode_handshake_request(frame: bytes | bytearray | memoryview) -> None:
    """Accept the handshake request frame; raise ``WireDecodeError`` for anything else."""
    if bytes(frame[: len(HANDSHAKE_REQUEST) + 1]) != HANDSHAKE_REQUEST:
        shown = bytes(frame[:32])
        raise WireDecodeError(_WHOLE, f"expected the handshake request {HANDSHAKE_REQUEST!r}, got {shown!r}")


def encode_handshake_reply(reply: HandshakeReply) -> tuple[bytes, bytes]:
    """Encode the two reply payloads (each is sent as ``[b"", payload]``)."""
    meta = reply.metadata
    metadata = msgpack.packb(
        {
            "engine_id": meta.engine_id,
            "agent_metadata": bytes(meta.agent_metadata),
            "kv_caches_base_addr": list(meta.kv_caches_base_addr),
            "num_blocks": meta.num_blocks,
            "block_len": meta.block_len,
            "attn_backend_name": meta.attn_backend_name,
            **({"kv_format": dict(meta.kv_format)} if meta.kv_format is not None else {}),
        }
    )
    layers = msgpack.packb({name: [bytes(d) for d in descs] for name, descs in reply.layer_memory.items()})
    return metadata, layers


def decode_handshake_reply(
    metadata_frame: bytes, layers_frame: bytes, *, limits: WireLimits = DEFAULT_LIMITS
) -> HandshakeReply:
    """Decode and validate both reply payloads; raises only ``WireDecodeError``."""
    try:
        return _decode_handshake_reply(metadata_frame, layers_frame, limits)
    except WireDecodeError:
        raise
    except Exception as exc:
        raise WireDecodeError(_WHOLE, f"undecodable handshake reply ({_type_name(exc)}: {exc})") from exc


def _unpack_map(frame: Any, what: str, limits: WireLimits) -> dict:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise WireDecodeError(what, f"expected bytes, got {_type_name(frame)}")
    if len(frame) > limits.max_handshake_bytes:
        raise WireDecodeError(what, f"{len(frame)} bytes exceeds the limit of {limits.max_handshake_bytes}")
    try:
        data = _unpack_bounded(bytes(frame), limits._handshake_options)
    except Exception as exc:
        raise WireDecodeError(what, f"invalid msgpack ({_type_name(exc)}: {exc})") from None
    if not isinstance(data, dict):
        raise WireDecodeError(what, f"expected a map, got {_type_name(data)}")
    return data


def _decode_handshake_reply(metadata_frame: Any, layers_frame: Any, limits: WireLimits) -> HandshakeReply:
    data = _unpack_map(metadata_frame, "metadata", limits)
    for name in _METADATA_FIELDS:
        if name not in data:
            raise WireDecodeError(f"metadata.{name}", "missing")
    engine_id = _check_id(data["engine_id"], "metadata.engine_id", limits, WireDecodeError)
    blob = data["agent_metadata"]
    if type(blob) is not bytes or not blob:
        raise WireDecodeError("metadata.agent_metadata", "expected non-empty binary data")
    addresses = data["kv_caches_base_addr"]
    if not isinstance(addresses, tuple):
        raise WireDecodeError("metadata.kv_caches_base_addr", f"expected a list, got {_type_name(addresses)}")
    for index, address in enumerate(addresses):
        _check_int(address, f"metadata.kv_caches_base_addr[{index}]", 0, _MAX_U64, WireDecodeError)
    num_blocks = _check_int(data["num_blocks"], "metadata.num_blocks", 1, _MAX_U64, WireDecodeError)
    block_len = _check_int(data["block_len"], "metadata.block_len", 1, _MAX_U64, WireDecodeError)
    backend = _check_id(data["attn_backend_name"], "metadata.attn_backend_name", limits, WireDecodeError)

    layers_raw = _unpack_map(layers_frame, "layers", limits)
    layers: dict[str, tuple[bytes, ...]] = {}
    for layer, descriptors in layers_raw.items():
        name = _check_id(layer, "layers.<name>", limits, WireDecodeError)
        where = f"layers[{name!r}]"
        if not isinstance(descriptors, tuple) or not descriptors:
            raise WireDecodeError(where, "expected a non-empty list of packed memory descriptors")
        if len(descriptors) > limits.max_descriptors_per_layer:
            raise WireDecodeError(where, f"{len(descriptors)} descriptors exceeds the limit of {limits.max_descriptors_per_layer}")
        for index, desc in enumerate(descriptors):
            if type(desc) is not bytes or not desc:
                raise WireDecodeError(f"{where}[{index}]", "expected non-empty binary data")
        layers[name] = descriptors
    kv_format = data.get("kv_format")
    if kv_format is not None:
        if not isinstance(kv_format, dict) or len(kv_format) > 32:
            raise WireDecodeError("metadata.kv_format", f"expected a small map, got {_type_name(kv_format)}")
        for key, value in kv_format.items():
            _check_id(key, "metadata.kv_format.<key>", limits, WireDecodeError)
            if type(value) is int:
                _check_int(value, f"metadata.kv_format[{key!r}]", 0, _MAX_U64, WireDecodeError)
            else:
                _check_id(value, f"metadata.kv_format[{key!r}]", limits, WireDecodeError)
        kv_format = MappingProxyType(dict(kv_format))
    metadata = AgentMetadata(engine_id, blob, addresses, num_blocks, block_len, backend, kv_format)
    return HandshakeReply(metadata, MappingProxyType(layers))
