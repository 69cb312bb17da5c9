"""Upper bounds on what a peer may send, and msgpack unpacking whose memory those bounds cap.

Rules: every limit is a positive, inclusive bound checked at construction; an unpacker never
allocates more than its frame's size can justify, however the frame's headers lie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = ["DEFAULT_LIMITS", "WireLimits", "unpack_bounded"]


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
            "max_message_bytes",
            "max_id_length",
            "max_blocks",
            "max_groups",
            "max_block_id",
            "max_rank",
            "max_count",
            "max_map_entries",
            "max_handshake_bytes",
            "max_layers",
            "max_descriptors_per_layer",
            "max_blob_bytes",
            "max_reason_length",
            "max_seq",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        lease = self.max_lease_s
        if type(lease) not in (int, float) or not math.isfinite(lease) or lease <= 0:
            raise ValueError(
                f"max_lease_s: expected a positive finite number of seconds, got {lease!r}"
            )
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


def unpack_bounded(frame: bytes, options: dict, small: dict | None = None) -> Any:
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
            raise ValueError(
                "incomplete: a length declared in the frame runs past its end"
            ) from None
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
