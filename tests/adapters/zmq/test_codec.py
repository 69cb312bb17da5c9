"""Wire codec: upstream's exact bytes round-trip, strict validation, clear errors; decoded messages become events.

Rules: frames are written exactly as upstream peers write them; a bad frame raises ``WireDecodeError`` naming the
field; hostile lengths are checked by what the decoder allocates (tracemalloc), never by how long it takes.
"""

from __future__ import annotations

import struct
import tracemalloc

import msgpack
import pytest

from moriio_fsm.adapters.zmq import (
    HANDSHAKE_REQUEST,
    AgentMetadata,
    HandshakeReply,
    Release,
    RemoteBlocks,
    Role,
    WireDecodeError,
    WireEncodeError,
    WireForm,
    WireLimits,
    WriteDone,
    WriteFailed,
    decode_handshake_reply,
    decode_handshake_request,
    decode_notify,
    encode_handshake_reply,
    encode_notify,
    event_for,
)
from moriio_fsm.runtime.declared import events
from moriio_fsm.runtime.events import Event

# Frames exactly as upstream MoRIIO peers write them: msgpack.dumps (packb with
# default options) of dicts in upstream's key order, or a bare UTF-8 id.
UPSTREAM_FRAMES = [
    (
        Role.PRODUCER,
        msgpack.dumps(
            {
                "req_id": "req-1",
                "transfer_id": "tx-1",
                "block_notify_list": [4, 5, 9],
                "decode_rank": 0,
                "type": "remote_blocks",
            }
        ),
        RemoteBlocks("tx-1", "req-1", (4, 5, 9), 0),
    ),
    (
        Role.PRODUCER,
        msgpack.dumps(
            {
                "req_id": "req-2",
                "transfer_id": "tx-2",
                "block_notify_list": [[1, 2], [300, 70000]],
                "decode_rank": 3,
                "type": "remote_blocks",
            }
        ),
        RemoteBlocks("tx-2", "req-2", ((1, 2), (300, 70000)), 3),
    ),
    (
        Role.PRODUCER,
        msgpack.dumps(
            {"req_id": "req-3", "transfer_id": "tx-3", "block_notify_list": [7], "decode_rank": 1}
        ),
        RemoteBlocks("tx-3", "req-3", (7,), 1, WireForm.UNTYPED),
    ),
    (
        Role.CONSUMER,
        msgpack.dumps({"type": "write_done", "transfer_id": "tx-4"}),
        WriteDone("tx-4"),
    ),
    (
        Role.CONSUMER,
        msgpack.dumps({"type": "write_done", "transfer_id": "tx-5", "num_writers": 4}),
        WriteDone("tx-5", 4),
    ),
    (
        Role.CONSUMER,
        msgpack.dumps({"type": "write_failed", "transfer_id": "tx-6"}),
        WriteFailed("tx-6"),
    ),
    (Role.PRODUCER, msgpack.dumps({"type": "release", "transfer_id": "tx-7"}), Release("tx-7")),
    (
        Role.PRODUCER,
        msgpack.dumps({"type": "release", "transfer_id": "tx-8", "consumer_tp_size": 8}),
        Release("tx-8", 8),
    ),
    (Role.PRODUCER, b"tx-9", Release("tx-9", form=WireForm.BARE_ID)),
    (Role.PRODUCER, b"tx-10:tp3", Release("tx-10", sender_tp_rank=3, form=WireForm.BARE_ID)),
    (Role.CONSUMER, b"tx-11", WriteDone("tx-11", form=WireForm.BARE_ID)),
    # A one-character id is also a valid msgpack integer; upstream reads it as an id.
    (Role.CONSUMER, b"7", WriteDone("7", form=WireForm.BARE_ID)),
]


@pytest.mark.parametrize("role,frame,expected", UPSTREAM_FRAMES)
def test_upstream_frames_decode_and_reencode_byte_for_byte(role, frame, expected):
    message = decode_notify(frame, role=role)
    assert message == expected
    assert message.form is expected.form
    assert encode_notify(message) == frame


def test_untyped_remote_blocks_can_be_written_in_todays_form():
    legacy = decode_notify(
        msgpack.dumps(
            {"req_id": "r", "transfer_id": "t", "block_notify_list": [1], "decode_rank": 0}
        ),
        role=Role.PRODUCER,
    )
    modern = RemoteBlocks(legacy.transfer_id, legacy.req_id, legacy.block_ids, legacy.decode_rank)
    assert msgpack.loads(encode_notify(modern))["type"] == "remote_blocks"


def test_unknown_extra_fields_from_newer_peers_are_ignored():
    frame = msgpack.dumps({"type": "write_done", "transfer_id": "tx", "trace": "abc"})
    assert decode_notify(frame, role=Role.CONSUMER) == WriteDone("tx")


def test_decoded_messages_become_the_machines_events():
    blocks = event_for(decode_notify(UPSTREAM_FRAMES[1][1], role=Role.PRODUCER), 12.5)
    # Each kind is its own class made from the specs, a subclass of Event.
    assert type(blocks) is events.remote_blocks and isinstance(blocks, Event)
    assert (blocks.transfer_id, blocks.kind, blocks.time, blocks.source) == (
        "tx-2",
        "remote_blocks",
        12.5,
        "",
    )
    assert dict(blocks.data) == {
        "block_ids": ((1, 2), (300, 70000)),
        "decode_rank": 3,
        "req_id": "req-2",
        "prompt_digest": "",
        "decode_dp_rank": -1,
    }
    # Fields upstream does not send become the defaults the specs declare.
    assert dict(event_for(WriteDone("a", 2), 0).data) == {"num_writers": 2, "producer_rank": -1}
    assert dict(event_for(WriteDone("a"), 0).data) == {
        "num_writers": 1,
        "producer_rank": -1,
    }  # one writer
    failed = event_for(WriteFailed("a"), 0)
    assert (failed.kind, dict(failed.data)) == (
        "write_failed",
        {"reason": "", "writes_stopped": True, "producer_rank": -1},
    )
    assert dict(event_for(Release("a", 4), 0).data) == {"consumer_tp_size": 4, "consumer_rank": -1}
    assert dict(event_for(Release("a"), 0).data) == {
        "consumer_tp_size": 1,
        "consumer_rank": -1,
    }  # one D rank
    with pytest.raises(AttributeError):
        blocks.req_id = "other"  # events are read-only


@pytest.mark.parametrize(
    "message",
    [
        RemoteBlocks("tx", "req", (1,)),
        WriteDone("tx"),
        WriteFailed("tx"),
        Release("tx", 2, 0, WireForm.BARE_ID),
    ],
)
def test_every_event_names_its_source_and_the_codec_knows_no_events(message):
    event = event_for(message, 3.0, source="10.0.0.7#00deadbeef")
    assert (event.transfer_id, event.kind, event.time, event.source) == (
        "tx",
        message.kind,
        3.0,
        "10.0.0.7#00deadbeef",
    )
    assert not hasattr(message, "to_event")


def test_event_for_refuses_what_is_not_a_notify_message():
    with pytest.raises(TypeError, match="got dict"):
        event_for({"type": "write_done", "transfer_id": "tx"}, 0.0)


BAD_FRAMES = [
    (b"", "<frame>", "empty"),
    (b"\xff\xfe\xfd", "<frame>", "neither a msgpack map nor a UTF-8"),
    (msgpack.dumps({"transfer_id": "t"}), "type", "missing"),
    (msgpack.dumps({"type": 5, "transfer_id": "t"}), "type", "expected a string"),
    (msgpack.dumps({"type": "hello", "transfer_id": "t"}), "type", "unknown message type 'hello'"),
    (msgpack.dumps({"type": "write_done"}), "transfer_id", "missing"),
    (msgpack.dumps({"type": "write_done", "transfer_id": ""}), "transfer_id", "must not be empty"),
    (
        msgpack.dumps({"type": "write_done", "transfer_id": 12}),
        "transfer_id",
        "expected a string, got int",
    ),
    (msgpack.dumps({"type": "write_done", "transfer_id": "a b"}), "transfer_id", "whitespace"),
    (
        msgpack.dumps({"type": "write_done", "transfer_id": "x" * 513}),
        "transfer_id",
        "exceeds the limit of 512",
    ),
    (
        msgpack.dumps({"type": "write_done", "transfer_id": "t", "num_writers": 0}),
        "num_writers",
        "out of range",
    ),
    (
        msgpack.dumps({"type": "write_done", "transfer_id": "t", "num_writers": True}),
        "num_writers",
        "expected an integer, got bool",
    ),
    (
        msgpack.dumps({"type": "write_done", "transfer_id": "t", "num_writers": 1.5}),
        "num_writers",
        "got float",
    ),
    (
        msgpack.dumps({"type": "release", "transfer_id": "t", "consumer_tp_size": -1}),
        "consumer_tp_size",
        "out of range",
    ),
    (
        msgpack.dumps({"type": "release", "transfer_id": "t", "consumer_tp_size": 10**6}),
        "consumer_tp_size",
        "out of range",
    ),
    (
        msgpack.dumps({"type": "remote_blocks", "transfer_id": "t", "block_notify_list": [1]}),
        "req_id",
        "missing",
    ),
    (
        msgpack.dumps({"type": "remote_blocks", "transfer_id": "t", "req_id": "r"}),
        "block_notify_list",
        "missing",
    ),
    (
        msgpack.dumps(
            {"type": "remote_blocks", "transfer_id": "t", "req_id": "r", "block_notify_list": []}
        ),
        "block_notify_list",
        "must not be empty",
    ),
    (
        msgpack.dumps(
            {
                "type": "remote_blocks",
                "transfer_id": "t",
                "req_id": "r",
                "block_notify_list": [1, -2],
            }
        ),
        "block_notify_list[1]",
        "out of range",
    ),
    (
        msgpack.dumps(
            {
                "type": "remote_blocks",
                "transfer_id": "t",
                "req_id": "r",
                "block_notify_list": [1, "2"],
            }
        ),
        "block_notify_list[1]",
        "expected an integer, got str",
    ),
    (
        msgpack.dumps(
            {
                "type": "remote_blocks",
                "transfer_id": "t",
                "req_id": "r",
                "block_notify_list": [[1], [2, None]],
            }
        ),
        "block_notify_list[1][1]",
        "got NoneType",
    ),
    (
        msgpack.dumps(
            {
                "type": "remote_blocks",
                "transfer_id": "t",
                "req_id": "r",
                "block_notify_list": [[1], 2],
            }
        ),
        "block_notify_list[1]",
        "expected a list of block ids",
    ),
    (
        msgpack.dumps(
            {
                "type": "remote_blocks",
                "transfer_id": "t",
                "req_id": "r",
                "block_notify_list": [[], []],
            }
        ),
        "block_notify_list",
        "every KV cache group is empty",
    ),
    (
        msgpack.dumps(
            {"type": "remote_blocks", "transfer_id": "t", "req_id": "r", "block_notify_list": "1,2"}
        ),
        "block_notify_list",
        "got str",
    ),
    (
        msgpack.dumps(
            {
                "type": "remote_blocks",
                "transfer_id": "t",
                "req_id": "r",
                "block_notify_list": [1],
                "decode_rank": -1,
            }
        ),
        "decode_rank",
        "out of range",
    ),
    (b"\x82\xa4type", "<frame>", "invalid msgpack map"),
]


@pytest.mark.parametrize("frame,field,reason", BAD_FRAMES)
def test_bad_frames_raise_one_error_naming_field_and_reason(frame, field, reason):
    with pytest.raises(WireDecodeError) as caught:
        decode_notify(frame, role=None if field != "<frame>" else Role.PRODUCER)
    assert caught.value.field == field
    assert reason in caught.value.reason
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    "role,frame,meant_for",
    [
        (Role.CONSUMER, UPSTREAM_FRAMES[0][1], "producer"),
        (Role.CONSUMER, msgpack.dumps({"type": "release", "transfer_id": "t"}), "producer"),
        (Role.PRODUCER, msgpack.dumps({"type": "write_done", "transfer_id": "t"}), "consumer"),
        (Role.PRODUCER, msgpack.dumps({"type": "write_failed", "transfer_id": "t"}), "consumer"),
    ],
)
def test_messages_for_the_other_role_are_rejected(role, frame, meant_for):
    with pytest.raises(WireDecodeError, match=f"meant for the {meant_for}"):
        decode_notify(frame, role=role)


def test_bare_id_without_a_role_is_ambiguous():
    with pytest.raises(WireDecodeError, match="needs the receiver's role"):
        decode_notify(b"tx-1")


def test_size_limits_are_enforced_before_decoding():
    big = msgpack.dumps({"type": "write_done", "transfer_id": "x" * 100})
    with pytest.raises(WireDecodeError, match="exceeds the limit of 64"):
        decode_notify(big, role=Role.CONSUMER, limits=WireLimits(max_message_bytes=64))
    limits = WireLimits(max_blocks=3)
    four = msgpack.dumps(
        {
            "type": "remote_blocks",
            "transfer_id": "t",
            "req_id": "r",
            "block_notify_list": [1, 2, 3, 4],
        }
    )
    with pytest.raises(WireDecodeError, match="4 block ids exceeds the limit of 3"):
        decode_notify(four, role=Role.PRODUCER, limits=limits)
    # Arrays longer than any legal list are refused by the unpacker itself.
    long = msgpack.dumps(
        {
            "type": "remote_blocks",
            "transfer_id": "t",
            "req_id": "r",
            "block_notify_list": list(range(100)),
        }
    )
    with pytest.raises(WireDecodeError, match="max_array_len"):
        decode_notify(long, role=Role.PRODUCER, limits=limits)
    groups = msgpack.dumps(
        {
            "type": "remote_blocks",
            "transfer_id": "t",
            "req_id": "r",
            "block_notify_list": [[1, 2], [3, 4]],
        }
    )
    with pytest.raises(WireDecodeError, match="4 block ids in all groups exceeds the limit of 3"):
        decode_notify(groups, role=Role.PRODUCER, limits=limits)


def test_a_huge_declared_array_is_refused_without_allocating_it():
    # array32 header claiming four billion entries in a 5-byte frame
    frame = b"\x81\xa4type\xdd\xff\xff\xff\xff"
    with pytest.raises(WireDecodeError, match="invalid msgpack map"):
        decode_notify(frame, role=Role.PRODUCER)


def _peak_bytes_while_decoding(frame: bytes, limits: WireLimits | None = None) -> int:
    limits = limits or WireLimits()
    tracemalloc.start()
    try:
        with pytest.raises(WireDecodeError, match="invalid msgpack map"):
            decode_notify(frame, role=Role.PRODUCER, limits=limits)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_declared_length_within_the_limit_but_beyond_the_frame_allocates_nothing():
    # 100k entries is a legal block list length, but this frame holds 14 bytes.
    frame = b"\x81\xa4type\xdd" + struct.pack(">I", 100_000)
    assert 100_000 <= WireLimits().max_blocks
    assert _peak_bytes_while_decoding(frame) < 64 * 1024  # a 100k tuple alone is 800 KB


def test_nested_headers_each_within_the_frame_size_allocate_nothing():
    # 1000 nested arrays each declaring about as many entries as the frame has bytes:
    # each passes a per-frame length cap, together they would ask for ~40 MB.
    headers = (b"\xdc" + struct.pack(">H", 5_000)) * 1_000
    frame = b"\x81\xa4type" + headers + b"\xc0" * (5_000 - len(headers))
    assert _peak_bytes_while_decoding(frame) < 256 * 1024


def test_a_complete_large_message_still_decodes():
    blocks = tuple(range(WireLimits().max_blocks))
    frame = msgpack.dumps(
        {"type": "remote_blocks", "transfer_id": "t", "req_id": "r", "block_notify_list": blocks}
    )
    assert decode_notify(frame, role=Role.PRODUCER).block_ids == blocks


def test_deeply_nested_input_is_an_ordinary_decode_error():
    frame = b"\x81\xa4type" + b"\x91" * 5000 + b"\x01"
    with pytest.raises(WireDecodeError):
        decode_notify(frame, role=Role.PRODUCER)


def test_bare_release_ids_round_trip_when_unambiguous():
    for message in (
        Release("x:tp3", sender_tp_rank=1, form=WireForm.BARE_ID),
        Release("x:tp123456", form=WireForm.BARE_ID),  # too many digits to be a rank
        Release("x:tpa", form=WireForm.BARE_ID),
    ):
        assert decode_notify(encode_notify(message), role=Role.PRODUCER) == message


def test_limits_reject_nonsense_settings():
    with pytest.raises(ValueError, match="max_blocks"):
        WireLimits(max_blocks=0)


@pytest.mark.parametrize(
    "message,field",
    [
        (WriteDone(""), "transfer_id"),
        (WriteDone("t", 0), "num_writers"),
        (Release("t", 0), "consumer_tp_size"),
        (RemoteBlocks("t", "r", ()), "block_notify_list"),
        (RemoteBlocks("t", "r", (1, -1)), "block_notify_list[1]"),
        (RemoteBlocks("t", "has space", (1,)), "req_id"),
        # A bare "x:tp3" would be read back as Release("x", sender_tp_rank=3).
        (Release("x:tp3", form=WireForm.BARE_ID), "transfer_id"),
    ],
)
def test_encoder_refuses_what_a_receiver_would_reject(message, field):
    with pytest.raises(WireEncodeError) as caught:
        encode_notify(message)
    assert caught.value.field == field


def test_handshake_request_and_reply_in_upstream_format():
    decode_handshake_request(HANDSHAKE_REQUEST)
    with pytest.raises(WireDecodeError, match="handshake request"):
        decode_handshake_request(b"get_meta_msgX")
    upstream_metadata = msgpack.dumps(
        {
            "engine_id": "prefill-0",
            "agent_metadata": b"\x00engine",
            "kv_caches_base_addr": [2**40, 2**63 + 5],
            "num_blocks": 1024,
            "block_len": 49152,
            "attn_backend_name": "ROCM_AITER_FA",
        }
    )
    upstream_layers = msgpack.dumps(
        {"model.layers.0.attn": [b"desc-k", b"desc-v"], "model.layers.1.attn": [b"d"]}
    )
    reply = decode_handshake_reply(upstream_metadata, upstream_layers)
    assert reply.metadata == AgentMetadata(
        "prefill-0", b"\x00engine", (2**40, 2**63 + 5), 1024, 49152, "ROCM_AITER_FA"
    )
    assert dict(reply.layer_memory) == {
        "model.layers.0.attn": (b"desc-k", b"desc-v"),
        "model.layers.1.attn": (b"d",),
    }
    assert encode_handshake_reply(reply) == (upstream_metadata, upstream_layers)


@pytest.mark.parametrize(
    "metadata,layers,field",
    [
        ({"engine_id": "e"}, {"l": [b"d"]}, "metadata.agent_metadata"),
        (
            {
                "engine_id": "e",
                "agent_metadata": "text",
                "kv_caches_base_addr": [],
                "num_blocks": 1,
                "block_len": 1,
                "attn_backend_name": "a",
            },
            {"l": [b"d"]},
            "metadata.agent_metadata",
        ),
        (
            {
                "engine_id": "e",
                "agent_metadata": b"x",
                "kv_caches_base_addr": [-1],
                "num_blocks": 1,
                "block_len": 1,
                "attn_backend_name": "a",
            },
            {"l": [b"d"]},
            "metadata.kv_caches_base_addr[0]",
        ),
        (
            {
                "engine_id": "e",
                "agent_metadata": b"x",
                "kv_caches_base_addr": [],
                "num_blocks": 0,
                "block_len": 1,
                "attn_backend_name": "a",
            },
            {"l": [b"d"]},
            "metadata.num_blocks",
        ),
        (
            {
                "engine_id": "e",
                "agent_metadata": b"x",
                "kv_caches_base_addr": [],
                "num_blocks": 1,
                "block_len": 1,
                "attn_backend_name": "a",
            },
            {"l": []},
            "layers['l']",
        ),
        (
            {
                "engine_id": "e",
                "agent_metadata": b"x",
                "kv_caches_base_addr": [],
                "num_blocks": 1,
                "block_len": 1,
                "attn_backend_name": "a",
            },
            [1],
            "layers",
        ),
    ],
)
def test_bad_handshake_replies_name_the_field(metadata, layers, field):
    with pytest.raises(WireDecodeError) as caught:
        decode_handshake_reply(msgpack.dumps(metadata), msgpack.dumps(layers))
    assert caught.value.field == field


def test_handshake_reply_roundtrip_from_values():
    reply = HandshakeReply(AgentMetadata("d-0", b"blob", (1, 2), 8, 64, "FA"), {"l0": (b"a",)})
    assert decode_handshake_reply(*encode_handshake_reply(reply)) == HandshakeReply(
        reply.metadata, {"l0": (b"a",)}
    )
