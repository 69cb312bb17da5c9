"""Fuzzing the decoder: whatever arrives, only WireDecodeError escapes.

Rules: hypothesis feeds random bytes and msgpack structures to every decoder, under both roles and none; any
other exception is a failure, and valid messages must round-trip through the encoder unchanged and become events.
"""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from moriio_fsm.adapters.zmq import (
    Heartbeat,
    LeaseGranted,
    Release,
    RemoteBlocks,
    Role,
    WireDecodeError,
    WireLimits,
    WriteDone,
    WriteFailed,
    decode_handshake_reply,
    decode_notify,
    encode_notify,
    event_for,
)

ROLES = st.sampled_from([None, Role.PRODUCER, Role.CONSUMER])
SMALL_LIMITS = WireLimits(max_message_bytes=2048, max_blocks=16, max_groups=4, max_id_length=32)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(
        [
            "remote_blocks",
            "write_done",
            "write_failed",
            "release",
            "heartbeat",
            "lease_granted",
            "tx-1",
            "req_id",
            "aborted",
        ]
    ),
)
structures = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "transfer_id",
                    "req_id",
                    "block_notify_list",
                    "decode_rank",
                    "num_writers",
                    "consumer_tp_size",
                    "producer_rank",
                    "consumer_rank",
                    "reason",
                    "writes_stopped",
                    "seq",
                    "lease_s",
                    "other",
                ]
            )
            | st.text(max_size=8),
            inner,
            max_size=6,
        ),
    ),
    max_leaves=30,
)


def _decode_only_typed_errors(frame: bytes, role, limits=SMALL_LIMITS) -> None:
    try:
        message = decode_notify(frame, role=role, limits=limits)
    except WireDecodeError as error:
        assert error.field and error.reason
        return
    # Anything accepted must be a typed message that encodes back cleanly and becomes an event.
    assert isinstance(
        message, (RemoteBlocks, WriteDone, WriteFailed, Release, Heartbeat, LeaseGranted)
    )
    assert decode_notify(encode_notify(message, limits=limits), role=role, limits=limits) == message
    assert event_for(message, 0.0).kind == message.kind


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), ROLES)
def test_random_bytes(frame, role):
    _decode_only_typed_errors(frame, role)


@settings(max_examples=400, deadline=None)
@given(structures, ROLES)
def test_random_msgpack_structures(value, role):
    _decode_only_typed_errors(msgpack.packb(value), role)


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                [
                    "remote_blocks",
                    "write_done",
                    "write_failed",
                    "release",
                    "heartbeat",
                    "lease_granted",
                ]
            ),
            "transfer_id": st.text(min_size=0, max_size=40),
        },
        optional={
            "req_id": structures,
            "block_notify_list": structures,
            "decode_rank": structures,
            "num_writers": structures,
            "consumer_tp_size": structures,
            "producer_rank": structures,
            "consumer_rank": structures,
            "reason": structures | st.text(max_size=80),
            "writes_stopped": structures,
            "seq": structures | st.integers(-2, 2**64 - 1),
            "lease_s": structures | st.floats() | st.integers(-2, 2**64 - 1),
        },
    ),
    ROLES,
)
def test_near_valid_messages(value, role):
    _decode_only_typed_errors(msgpack.packb(value), role)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_random_handshake_replies(metadata, layers):
    try:
        decode_handshake_reply(metadata, layers, limits=SMALL_LIMITS)
    except WireDecodeError:
        pass


ids = st.text(
    st.characters(
        min_codepoint=33,
        max_codepoint=0x2FFF,
        blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp", "Cn", "Co", "Cf"),
    ),
    min_size=1,
    max_size=32,
)
block_lists = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=16)
ranks = st.none() | st.integers(0, 65535)
reasons = st.none() | st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Cf", "Zl", "Zp", "Co", "Cn")),
    min_size=1,
    max_size=64,
).filter(str.isprintable)
seqs = st.integers(0, 2**63 - 1)
leases = st.floats(0.0, 86_400.0, allow_nan=False) | st.integers(0, 86_400)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.builds(RemoteBlocks, ids, ids, block_lists.map(tuple), st.integers(0, 65535)),
        st.builds(
            RemoteBlocks,
            ids,
            ids,
            st.lists(
                st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4).map(tuple),
                min_size=1,
                max_size=4,
            ).map(tuple),
        ),
        st.builds(WriteDone, ids, st.none() | st.integers(1, 65536), producer_rank=ranks),
        st.builds(
            WriteFailed,
            ids,
            reason=reasons,
            writes_stopped=st.none() | st.booleans(),
            producer_rank=ranks,
        ),
        st.builds(Release, ids, st.none() | st.integers(1, 65536), consumer_rank=ranks),
        st.builds(Heartbeat, ids, seqs, ranks),
        st.builds(LeaseGranted, ids, seqs, leases, ranks),
    )
)
def test_valid_messages_roundtrip(message):
    frame = encode_notify(message, limits=SMALL_LIMITS)
    assert decode_notify(frame, limits=SMALL_LIMITS) == message
