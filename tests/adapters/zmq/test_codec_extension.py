"""The protocol extension: optional ranks, write_failed's reason and verdict, heartbeat and lease_granted.

Rules: with no extension field set every message is upstream's bytes (checked against literal bytes); every
message round-trips with and without its optional fields; unknown keys are ignored, unknown types refused;
each hostile value is a ``WireDecodeError`` (decoding) or ``WireEncodeError`` (encoding) naming its field.
"""

from __future__ import annotations

import math
import queue

import msgpack
import pytest

from moriio_fsm.adapters.zmq import (
    Heartbeat,
    LeaseGranted,
    Release,
    RemoteBlocks,
    Role,
    TransportConfig,
    WireDecodeError,
    WireEncodeError,
    WireForm,
    WireLimits,
    WriteDone,
    WriteFailed,
    ZmqTransport,
    decode_notify,
    encode_notify,
    event_for,
)
from moriio_fsm.runtime.declared import events

HOST = "127.0.0.1"


def _role_of(message) -> Role:
    return (
        Role.CONSUMER
        if message.kind in ("write_done", "write_failed", "lease_granted")
        else Role.PRODUCER
    )


# ---------------------------------------------------------------------------
# upstream's bytes are unchanged
# ---------------------------------------------------------------------------

# Literal bytes, not msgpack.dumps: a change in how the encoder (or msgpack) builds
# a map would otherwise go unseen on both sides of the comparison.
UPSTREAM_BYTES = [
    (WriteDone("tx-4"), b"\x82\xa4type\xaawrite_done\xabtransfer_id\xa4tx-4"),
    (WriteDone("tx-5", 4), b"\x83\xa4type\xaawrite_done\xabtransfer_id\xa4tx-5\xabnum_writers\x04"),
    (WriteDone("tx-11", form=WireForm.BARE_ID), b"tx-11"),
    (WriteFailed("tx-6"), b"\x82\xa4type\xacwrite_failed\xabtransfer_id\xa4tx-6"),
    (Release("tx-7"), b"\x82\xa4type\xa7release\xabtransfer_id\xa4tx-7"),
    (Release("tx-8", 8), b"\x83\xa4type\xa7release\xabtransfer_id\xa4tx-8\xb0consumer_tp_size\x08"),
    (Release("tx-9", form=WireForm.BARE_ID), b"tx-9"),
    (Release("tx-10", sender_tp_rank=3, form=WireForm.BARE_ID), b"tx-10:tp3"),
    (
        RemoteBlocks("tx-1", "req-1", (4, 5, 9), 0),
        b"\x85\xa6req_id\xa5req-1\xabtransfer_id\xa4tx-1\xb1block_notify_list\x93\x04\x05\t\xabdecode_rank\x00"
        b"\xa4type\xadremote_blocks",
    ),
]


@pytest.mark.parametrize("message,frame", UPSTREAM_BYTES)
def test_messages_without_extension_fields_are_upstreams_bytes(message, frame):
    assert encode_notify(message) == frame
    # The same bytes as upstream's msgpack.dumps of its dict, for the structured forms.
    if frame[0] & 0xF0 == 0x80:
        assert msgpack.dumps(msgpack.loads(frame)) == frame
    decoded = decode_notify(frame, role=_role_of(message))
    assert decoded == message and decoded.form is message.form


# ---------------------------------------------------------------------------
# the extension's exact wire form
# ---------------------------------------------------------------------------

EXTENSION_BYTES = [
    (
        WriteDone("tx", 2, producer_rank=1),
        b"\x84\xa4type\xaawrite_done\xabtransfer_id\xa2tx\xabnum_writers\x02\xadproducer_rank\x01",
    ),
    (
        WriteDone("tx", producer_rank=0),
        b"\x83\xa4type\xaawrite_done\xabtransfer_id\xa2tx\xadproducer_rank\x00",
    ),
    (
        WriteFailed("tx", reason="aborted", writes_stopped=False, producer_rank=0),
        b"\x85\xa4type\xacwrite_failed\xabtransfer_id\xa2tx\xa6reason\xa7aborted\xaewrites_stopped\xc2"
        b"\xadproducer_rank\x00",
    ),
    (
        WriteFailed("tx", writes_stopped=True),
        b"\x83\xa4type\xacwrite_failed\xabtransfer_id\xa2tx\xaewrites_stopped\xc3",
    ),
    (
        Release("tx", 2, consumer_rank=1),
        b"\x84\xa4type\xa7release\xabtransfer_id\xa2tx\xb0consumer_tp_size\x02\xadconsumer_rank\x01",
    ),
    (
        Heartbeat("tx", 7, 1),
        b"\x84\xa4type\xa9heartbeat\xabtransfer_id\xa2tx\xadconsumer_rank\x01\xa3seq\x07",
    ),
    (Heartbeat("tx", 0), b"\x83\xa4type\xa9heartbeat\xabtransfer_id\xa2tx\xa3seq\x00"),
    (
        LeaseGranted("tx", 7, 30.0, 1),
        b"\x85\xa4type\xadlease_granted\xabtransfer_id\xa2tx\xadconsumer_rank\x01\xa3seq\x07"
        b"\xa7lease_s\xcb@>\x00\x00\x00\x00\x00\x00",
    ),
]


@pytest.mark.parametrize("message,frame", EXTENSION_BYTES)
def test_extension_fields_are_written_last_and_only_when_set(message, frame):
    assert encode_notify(message) == frame
    assert decode_notify(frame) == message


# ---------------------------------------------------------------------------
# round trips, with and without every optional field
# ---------------------------------------------------------------------------

ROUND_TRIPS = [
    # remote_blocks has no optional extension field; both of upstream's forms
    RemoteBlocks("tx", "req", (1, 2)),
    RemoteBlocks("tx", "req", ((1,), (2, 3)), 5, WireForm.UNTYPED),
    WriteDone("tx"),
    WriteDone("tx", 3),
    WriteDone("tx", producer_rank=0),
    WriteDone("tx", 3, producer_rank=65_535),
    WriteDone("tx", form=WireForm.BARE_ID),
    WriteFailed("tx"),
    WriteFailed("tx", reason="expired"),
    WriteFailed("tx", reason="r" * 64),
    WriteFailed("tx", reason="write failed: code 7"),  # spaces are printable
    WriteFailed("tx", writes_stopped=False),
    WriteFailed("tx", writes_stopped=True),
    WriteFailed("tx", producer_rank=2),
    WriteFailed("tx", reason="released", writes_stopped=False, producer_rank=0),
    Release("tx"),
    Release("tx", 4),
    Release("tx", consumer_rank=0),
    Release("tx", 4, consumer_rank=3),
    Release("tx", sender_tp_rank=2, form=WireForm.BARE_ID),
    Heartbeat("tx", 0),
    Heartbeat("tx", (1 << 63) - 1),
    Heartbeat("tx", 9, 0),
    LeaseGranted("tx", 0, 0.0),
    LeaseGranted("tx", 1, 30.0, 0),
    LeaseGranted("tx", 2, 0.125, 65_535),
    LeaseGranted("tx", 3, 86_400.0),
]


@pytest.mark.parametrize("message", ROUND_TRIPS, ids=repr)
def test_every_message_round_trips(message):
    frame = encode_notify(message)
    decoded = decode_notify(frame, role=_role_of(message))
    assert decoded == message
    assert decoded.form is message.form
    assert encode_notify(decoded) == frame
    if message.form is not WireForm.BARE_ID:
        assert decode_notify(frame) == message  # a structured message needs no role


def test_whole_seconds_may_arrive_as_an_integer_and_decode_as_float():
    frame = msgpack.dumps({"type": "lease_granted", "transfer_id": "tx", "seq": 1, "lease_s": 30})
    message = decode_notify(frame, role=Role.CONSUMER)
    assert type(message.lease_s) is float and message.lease_s == 30.0
    assert encode_notify(LeaseGranted("tx", 1, 30)) == encode_notify(LeaseGranted("tx", 1, 30.0))


def test_negative_zero_lease_is_zero():
    frame = msgpack.dumps({"type": "lease_granted", "transfer_id": "tx", "seq": 1, "lease_s": -0.0})
    assert math.copysign(1.0, decode_notify(frame).lease_s) == 1.0
    assert (
        math.copysign(1.0, msgpack.loads(encode_notify(LeaseGranted("tx", 1, -0.0)))["lease_s"])
        == 1.0
    )


def test_a_float32_lease_from_another_msgpack_is_accepted():
    frame = b"\x84\xa4type\xadlease_granted\xabtransfer_id\xa2tx\xa3seq\x01\xa7lease_s\xca\x40\x20\x00\x00"
    assert decode_notify(frame) == LeaseGranted("tx", 1, 2.5)


def test_nil_optional_fields_mean_absent():
    frame = msgpack.dumps(
        {
            "type": "write_failed",
            "transfer_id": "tx",
            "reason": None,
            "writes_stopped": None,
            "producer_rank": None,
        }
    )
    assert decode_notify(frame) == WriteFailed("tx")


def test_extension_fields_are_keyword_only_so_positional_calls_keep_their_meaning():
    assert WriteDone("tx", 2, WireForm.BARE_ID).form is WireForm.BARE_ID
    assert Release("tx", 2, 0, WireForm.BARE_ID).sender_tp_rank == 0
    assert WriteFailed("tx", WireForm.TYPED).reason is None
    with pytest.raises(TypeError):
        WriteDone("tx", 2, WireForm.TYPED, 1)


# ---------------------------------------------------------------------------
# unknown keys are ignored (every type), unknown types are refused
# ---------------------------------------------------------------------------

# What a newer peer might add: scalars, nested structures, a key named like ours in
# another message, binary. None of it may change what an older listener decodes.
EXTRA_KEYS = {
    "trace_id": "abc-123",
    "future_flag": True,
    "future_list": [1, [2, 3], {"x": 1.5}],
    "future_map": {"nested": {"deeper": None}},
    "future_bin": b"\x00\x01",
    "lease": 5.0,
}

EVERY_TYPE = [
    {
        "req_id": "r",
        "transfer_id": "tx",
        "block_notify_list": [1, 2],
        "decode_rank": 1,
        "type": "remote_blocks",
    },
    {
        "req_id": "r",
        "transfer_id": "tx",
        "block_notify_list": [[1], [2]],
        "decode_rank": 0,
    },  # untyped form
    {"type": "write_done", "transfer_id": "tx"},
    {"type": "write_done", "transfer_id": "tx", "num_writers": 2, "producer_rank": 1},
    {"type": "write_failed", "transfer_id": "tx"},
    {
        "type": "write_failed",
        "transfer_id": "tx",
        "reason": "failed",
        "writes_stopped": False,
        "producer_rank": 0,
    },
    {"type": "release", "transfer_id": "tx"},
    {"type": "release", "transfer_id": "tx", "consumer_tp_size": 2, "consumer_rank": 1},
    {"type": "heartbeat", "transfer_id": "tx", "seq": 4},
    {"type": "heartbeat", "transfer_id": "tx", "consumer_rank": 2, "seq": 4},
    {"type": "lease_granted", "transfer_id": "tx", "seq": 4, "lease_s": 30.0},
    {"type": "lease_granted", "transfer_id": "tx", "consumer_rank": 2, "seq": 4, "lease_s": 30.0},
]


@pytest.mark.parametrize("fields", EVERY_TYPE, ids=lambda f: f.get("type", "untyped"))
def test_unknown_keys_are_ignored_for_every_type(fields):
    plain = msgpack.dumps(fields)
    expected = decode_notify(plain)
    for extra in (
        {**fields, **EXTRA_KEYS},
        {**EXTRA_KEYS, **fields},
    ):  # before and after the known keys
        with_extra = decode_notify(msgpack.dumps(extra))
        assert with_extra == expected and with_extra.form is expected.form
        assert encode_notify(with_extra) == encode_notify(expected)  # and they are not passed on


@pytest.mark.parametrize("kind", ["lease_revoked", "heartbeat_v2", "HEARTBEAT", "write_done ", ""])
@pytest.mark.parametrize("role", [None, Role.PRODUCER, Role.CONSUMER])
def test_an_unknown_message_type_is_still_a_decode_error(kind, role):
    with pytest.raises(WireDecodeError) as caught:
        decode_notify(msgpack.dumps({"type": kind, "transfer_id": "tx", "seq": 1}), role=role)
    assert caught.value.field == "type"
    assert "unknown message type" in caught.value.reason
    assert (
        "heartbeat" in caught.value.reason and "lease_granted" in caught.value.reason
    )  # lists what is known


@pytest.mark.parametrize(
    "role,fields,meant_for",
    [
        (Role.CONSUMER, {"type": "heartbeat", "transfer_id": "tx", "seq": 1}, "producer"),
        (
            Role.PRODUCER,
            {"type": "lease_granted", "transfer_id": "tx", "seq": 1, "lease_s": 1.0},
            "consumer",
        ),
    ],
)
def test_new_messages_are_refused_by_the_wrong_role(role, fields, meant_for):
    with pytest.raises(WireDecodeError, match=f"meant for the {meant_for}"):
        decode_notify(msgpack.dumps(fields), role=role)


# ---------------------------------------------------------------------------
# hostile values of the new fields
# ---------------------------------------------------------------------------

HUGE_INT = (1 << 64) - 1  # the largest msgpack integer
HOSTILE = [
    # field, base message, value, what the error says
    *[
        (rank_field, base, value, reason)
        for rank_field, base in [
            ("producer_rank", {"type": "write_done", "transfer_id": "tx"}),
            ("producer_rank", {"type": "write_failed", "transfer_id": "tx"}),
            ("consumer_rank", {"type": "release", "transfer_id": "tx"}),
            ("consumer_rank", {"type": "heartbeat", "transfer_id": "tx", "seq": 1}),
            (
                "consumer_rank",
                {"type": "lease_granted", "transfer_id": "tx", "seq": 1, "lease_s": 1.0},
            ),
        ]
        for value, reason in [
            (True, "expected an integer, got bool"),
            (False, "expected an integer, got bool"),
            (1.0, "expected an integer, got float"),
            ("1", "expected an integer, got str"),
            (b"\x01", "expected an integer, got bytes"),
            ([1], "expected an integer, got tuple"),
            (-1, "out of range [0, 65535]"),
            (65_536, "out of range [0, 65535]"),
            (HUGE_INT, "out of range [0, 65535]"),
            (-(1 << 63), "out of range [0, 65535]"),
        ]
    ],
    ("reason", {"type": "write_failed", "transfer_id": "tx"}, 5, "expected a string, got int"),
    ("reason", {"type": "write_failed", "transfer_id": "tx"}, True, "expected a string, got bool"),
    (
        "reason",
        {"type": "write_failed", "transfer_id": "tx"},
        b"failed",
        "expected a string, got bytes",
    ),
    ("reason", {"type": "write_failed", "transfer_id": "tx"}, "", "must not be empty"),
    (
        "reason",
        {"type": "write_failed", "transfer_id": "tx"},
        "x" * 65,
        "65 characters exceeds the limit of 64",
    ),
    (
        "reason",
        {"type": "write_failed", "transfer_id": "tx"},
        "x" * 2000,
        "2000 characters exceeds the limit",
    ),
    ("reason", {"type": "write_failed", "transfer_id": "tx"}, "bad\nline", "printable"),
    ("reason", {"type": "write_failed", "transfer_id": "tx"}, "nul\x00", "printable"),
    ("reason", {"type": "write_failed", "transfer_id": "tx"}, "\x1b[31mred", "printable"),
    (
        "writes_stopped",
        {"type": "write_failed", "transfer_id": "tx"},
        1,
        "expected a boolean, got int",
    ),
    (
        "writes_stopped",
        {"type": "write_failed", "transfer_id": "tx"},
        0,
        "expected a boolean, got int",
    ),
    (
        "writes_stopped",
        {"type": "write_failed", "transfer_id": "tx"},
        "true",
        "expected a boolean, got str",
    ),
    (
        "writes_stopped",
        {"type": "write_failed", "transfer_id": "tx"},
        1.0,
        "expected a boolean, got float",
    ),
    *[
        ("seq", {"type": kind, "transfer_id": "tx", "lease_s": 1.0}, value, reason)
        for kind in ("heartbeat", "lease_granted")
        for value, reason in [
            (True, "expected an integer, got bool"),
            (1.5, "expected an integer, got float"),
            (float("nan"), "expected an integer, got float"),
            ("7", "expected an integer, got str"),
            (None, "expected an integer, got NoneType"),
            (-1, "out of range"),
            (1 << 63, "out of range"),
            (HUGE_INT, "out of range"),
        ]
    ],
    *[
        ("lease_s", {"type": "lease_granted", "transfer_id": "tx", "seq": 1}, value, reason)
        for value, reason in [
            (float("nan"), "expected a finite number of seconds, got nan"),
            (float("inf"), "expected a finite number of seconds, got inf"),
            (float("-inf"), "expected a finite number of seconds, got -inf"),
            (-0.5, "out of range"),
            (-1, "out of range"),
            (86_400.5, "out of range"),
            (1e308, "out of range"),
            (HUGE_INT, "out of range"),
            (True, "expected a number of seconds, got bool"),
            ("30", "expected a number of seconds, got str"),
            (None, "expected a number of seconds, got NoneType"),
            ([30.0], "expected a number of seconds, got tuple"),
        ]
    ],
]


@pytest.mark.parametrize("field,base,value,reason", HOSTILE)
def test_hostile_values_of_new_fields_are_refused_naming_the_field(field, base, value, reason):
    frame = msgpack.dumps({**base, field: value})
    with pytest.raises(WireDecodeError) as caught:
        decode_notify(frame)
    assert (caught.value.field, reason in caught.value.reason) == (field, True), caught.value.reason


@pytest.mark.parametrize(
    "fields,missing",
    [
        ({"type": "heartbeat", "transfer_id": "tx"}, "seq"),
        ({"type": "heartbeat", "transfer_id": "tx", "consumer_rank": 0}, "seq"),
        ({"type": "lease_granted", "transfer_id": "tx", "lease_s": 1.0}, "seq"),
        ({"type": "lease_granted", "transfer_id": "tx", "seq": 1}, "lease_s"),
        ({"type": "heartbeat", "seq": 1}, "transfer_id"),
        ({"type": "lease_granted", "seq": 1, "lease_s": 1.0}, "transfer_id"),
    ],
)
def test_required_fields_of_new_messages(fields, missing):
    with pytest.raises(WireDecodeError) as caught:
        decode_notify(msgpack.dumps(fields))
    assert (caught.value.field, caught.value.reason) == (missing, "missing")


@pytest.mark.parametrize(
    "lease_nan",
    [
        b"\xca\x7f\xc0\x00\x00",  # float32 NaN
        b"\xca\x7f\x80\x00\x00",  # float32 +inf
        b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x01",  # float64 NaN with a payload
    ],
)
def test_non_finite_floats_in_any_encoding_are_refused(lease_nan):
    frame = b"\x84\xa4type\xadlease_granted\xabtransfer_id\xa2tx\xa3seq\x01\xa7lease_s" + lease_nan
    with pytest.raises(WireDecodeError) as caught:
        decode_notify(frame)
    assert caught.value.field == "lease_s"


def test_a_reason_longer_than_any_string_the_frame_allows_is_refused_by_the_unpacker():
    # Beyond 4 bytes a character of the longest limit, msgpack refuses the string before building it.
    frame = msgpack.dumps({"type": "write_failed", "transfer_id": "tx", "reason": "x" * 5000})
    with pytest.raises(WireDecodeError, match="invalid msgpack map"):
        decode_notify(frame, role=Role.CONSUMER)


def test_limits_bound_the_new_fields():
    limits = WireLimits(max_reason_length=4, max_seq=10, max_lease_s=5.0, max_rank=3)
    for fields, field in [
        ({"type": "write_failed", "transfer_id": "tx", "reason": "abcde"}, "reason"),
        ({"type": "heartbeat", "transfer_id": "tx", "seq": 11}, "seq"),
        ({"type": "lease_granted", "transfer_id": "tx", "seq": 1, "lease_s": 5.5}, "lease_s"),
        ({"type": "write_done", "transfer_id": "tx", "producer_rank": 4}, "producer_rank"),
    ]:
        with pytest.raises(WireDecodeError) as caught:
            decode_notify(msgpack.dumps(fields), limits=limits)
        assert caught.value.field == field
    assert decode_notify(
        msgpack.dumps({"type": "heartbeat", "transfer_id": "tx", "seq": 10}), limits=limits
    )


@pytest.mark.parametrize(
    "setting",
    [
        {"max_reason_length": 0},
        {"max_seq": True},
        {"max_lease_s": float("nan")},
        {"max_lease_s": 0.0},
        {"max_lease_s": "1"},
        {"max_lease_s": float("inf")},
    ],
)
def test_limits_reject_nonsense_settings_for_the_new_bounds(setting):
    with pytest.raises(ValueError, match=next(iter(setting))):
        WireLimits(**setting)


ENCODE_REFUSALS = [
    (WriteDone("tx", producer_rank=-1), "producer_rank", "leave the field as None"),
    (WriteDone("tx", producer_rank=True), "producer_rank", "expected an integer, got bool"),
    (WriteDone("tx", producer_rank=65_536), "producer_rank", "out of range"),
    (WriteDone("tx", producer_rank=1.0), "producer_rank", "expected an integer, got float"),
    (WriteDone("tx", 0, producer_rank=1), "num_writers", "out of range"),
    (
        WriteDone("tx", producer_rank=1, form=WireForm.BARE_ID),
        "producer_rank",
        "bare-id form cannot carry it",
    ),
    (WriteFailed("tx", reason=""), "reason", "must not be empty"),
    (WriteFailed("tx", reason="x" * 65), "reason", "exceeds the limit of 64"),
    (WriteFailed("tx", reason="a\tb"), "reason", "printable"),
    (WriteFailed("tx", reason=5), "reason", "expected a string, got int"),
    (WriteFailed("tx", writes_stopped=1), "writes_stopped", "expected a boolean, got int"),
    (WriteFailed("tx", writes_stopped="no"), "writes_stopped", "expected a boolean, got str"),
    (WriteFailed("tx", producer_rank="0"), "producer_rank", "expected an integer, got str"),
    (WriteFailed("tx", producer_rank=-1), "producer_rank", "leave the field as None"),
    (Release("tx", consumer_rank=-1), "consumer_rank", "leave the field as None"),
    (Release("tx", consumer_rank=1 << 70), "consumer_rank", "out of range"),
    (
        Release("tx", consumer_rank=1, form=WireForm.BARE_ID),
        "consumer_rank",
        "bare-id form cannot carry it",
    ),
    (Heartbeat("tx", -1), "seq", "out of range"),
    (Heartbeat("tx", True), "seq", "expected an integer, got bool"),
    (Heartbeat("tx", 1 << 63), "seq", "out of range"),
    (Heartbeat("tx", None), "seq", "expected an integer, got NoneType"),
    (Heartbeat("tx", 1, 1.5), "consumer_rank", "expected an integer, got float"),
    (Heartbeat("tx", 1, form=WireForm.BARE_ID), "form", "only the typed form"),
    (Heartbeat("", 1), "transfer_id", "must not be empty"),
    (LeaseGranted("tx", 1, float("nan")), "lease_s", "finite"),
    (LeaseGranted("tx", 1, float("inf")), "lease_s", "finite"),
    (LeaseGranted("tx", 1, -1.0), "lease_s", "out of range"),
    (LeaseGranted("tx", 1, 10**400), "lease_s", "out of range"),  # too big even for a float
    (LeaseGranted("tx", 1, True), "lease_s", "expected a number of seconds, got bool"),
    (LeaseGranted("tx", 1, "30"), "lease_s", "expected a number of seconds, got str"),
    (LeaseGranted("tx", 1, None), "lease_s", "expected a number of seconds, got NoneType"),
    (LeaseGranted("tx", -1, 1.0), "seq", "out of range"),
    (LeaseGranted("tx", 1, 1.0, -1), "consumer_rank", "leave the field as None"),
    (LeaseGranted("tx", 1, 1.0, form=WireForm.UNTYPED), "form", "only the typed form"),
]


@pytest.mark.parametrize("message,field,reason", ENCODE_REFUSALS, ids=repr)
def test_encoder_refuses_bad_extension_values_naming_the_field(message, field, reason):
    with pytest.raises(WireEncodeError) as caught:
        encode_notify(message)
    assert caught.value.field == field
    assert reason in caught.value.reason, caught.value.reason


# ---------------------------------------------------------------------------
# every message kind becomes its event
# ---------------------------------------------------------------------------

EVENTS = [
    (
        RemoteBlocks("tx", "req-9", ((1, 2), (3,)), 4),
        events.remote_blocks,
        {
            "block_ids": ((1, 2), (3,)),
            "decode_rank": 4,
            "req_id": "req-9",
            "prompt_digest": "",
            "decode_dp_rank": -1,
        },
    ),
    (
        RemoteBlocks("tx", "req-9", (5,), 0, prompt_digest="00ff"),
        events.remote_blocks,
        {
            "block_ids": (5,),
            "decode_rank": 0,
            "req_id": "req-9",
            "prompt_digest": "00ff",
            "decode_dp_rank": -1,
        },
    ),
    (WriteDone("tx"), events.write_done, {"num_writers": 1, "producer_rank": -1}),
    (
        WriteDone("tx", 3, producer_rank=2),
        events.write_done,
        {"num_writers": 3, "producer_rank": 2},
    ),
    (WriteDone("tx", producer_rank=0), events.write_done, {"num_writers": 1, "producer_rank": 0}),
    (
        WriteFailed("tx"),
        events.write_failed,
        {"reason": "", "writes_stopped": True, "producer_rank": -1},
    ),
    (
        WriteFailed("tx", reason="aborted", writes_stopped=False, producer_rank=0),
        events.write_failed,
        {"reason": "aborted", "writes_stopped": False, "producer_rank": 0},
    ),
    (
        WriteFailed("tx", writes_stopped=True, producer_rank=5),
        events.write_failed,
        {"reason": "", "writes_stopped": True, "producer_rank": 5},
    ),
    (Release("tx"), events.release, {"consumer_tp_size": 1, "consumer_rank": -1}),
    (
        Release("tx", 4, consumer_rank=0),
        events.release,
        {"consumer_tp_size": 4, "consumer_rank": 0},
    ),
    (
        Release("tx", sender_tp_rank=3, form=WireForm.BARE_ID),
        events.release,
        {"consumer_tp_size": 1, "consumer_rank": 3},
    ),
    (
        Release("tx", sender_tp_rank=0, form=WireForm.BARE_ID),
        events.release,
        {"consumer_tp_size": 1, "consumer_rank": 0},
    ),
    (Heartbeat("tx", 6), events.heartbeat, {"consumer_rank": -1, "seq": 6}),
    (Heartbeat("tx", 6, 0), events.heartbeat, {"consumer_rank": 0, "seq": 6}),
    (
        LeaseGranted("tx", 6, 30.0),
        events.lease_granted,
        {"seq": 6, "lease_s": 30.0, "consumer_rank": -1},
    ),
    (
        LeaseGranted("tx", 6, 0.5, 0),
        events.lease_granted,
        {"seq": 6, "lease_s": 0.5, "consumer_rank": 0},
    ),
]


@pytest.mark.parametrize("message,event_class,data", EVENTS, ids=repr)
def test_event_for_every_message_kind(message, event_class, data):
    event = event_for(message, 4.25, source="10.0.0.9#0a0b")
    assert type(event) is event_class
    assert event.kind == message.kind  # the wire type and the event kind agree
    assert (event.transfer_id, event.time, event.source) == ("tx", 4.25, "10.0.0.9#0a0b")
    assert dict(event.data) == data
    assert all(type(value) is type(data[name]) for name, value in event.data.items())


def test_decoded_frames_become_the_same_events_as_built_messages():
    for message, _event_class, data in EVENTS:
        if message.form is WireForm.BARE_ID:
            continue
        decoded = decode_notify(encode_notify(message), role=_role_of(message))
        assert dict(event_for(decoded, 0.0).data) == data


# ---------------------------------------------------------------------------
# the new messages travel through the transport
# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_heartbeat_and_lease_granted_travel_between_transports():
    to_producer: queue.Queue = queue.Queue()
    to_consumer: queue.Queue = queue.Queue()
    producer = ZmqTransport(TransportConfig(role=Role.PRODUCER, bind_host=HOST), to_producer.put)
    try:
        consumer = ZmqTransport(
            TransportConfig(role=Role.CONSUMER, bind_host=HOST), to_consumer.put
        )
        try:
            consumer.send((HOST, producer.notify_port), Heartbeat("tx-r", 3, 1))
            beat = to_producer.get(timeout=10)
            assert beat.message == Heartbeat("tx-r", 3, 1)
            event = event_for(beat.message, beat.received_at, beat.source)
            assert (event.kind, dict(event.data)) == ("heartbeat", {"consumer_rank": 1, "seq": 3})

            producer.send((HOST, consumer.notify_port), LeaseGranted("tx-r", 3, 30.0, 1))
            grant = to_consumer.get(timeout=10)
            assert grant.message == LeaseGranted("tx-r", 3, 30.0, 1)
            event = event_for(grant.message, grant.received_at, grant.source)
            assert (event.kind, dict(event.data)) == (
                "lease_granted",
                {"seq": 3, "lease_s": 30.0, "consumer_rank": 1},
            )
        finally:
            consumer.close()
    finally:
        producer.close()


def test_heartbeat_reply_port_round_trips_and_is_checked():
    beat = Heartbeat("tx-9", 4, 1, reply_port=61006)
    frame = encode_notify(beat)
    assert msgpack.unpackb(frame)["reply_port"] == 61006
    assert decode_notify(frame, role=Role.PRODUCER) == beat
    assert "reply_port" not in msgpack.unpackb(encode_notify(Heartbeat("tx-9", 4)))
    for bad in (0, 70000, "61006", -1, 1.5):
        hostile = msgpack.packb(
            {"type": "heartbeat", "transfer_id": "tx-9", "seq": 1, "reply_port": bad}
        )
        with pytest.raises(WireDecodeError, match="reply_port"):
            decode_notify(hostile, role=Role.PRODUCER)
    with pytest.raises(WireEncodeError, match="reply_port"):
        encode_notify(Heartbeat("tx-9", 4, reply_port=0))


def test_handshake_kv_format_is_optional_and_checked():
    from moriio_fsm.adapters.zmq import (
        AgentMetadata,
        HandshakeReply,
        decode_handshake_reply,
        encode_handshake_reply,
    )

    meta = AgentMetadata("P", b"desc", (4096,), 16, 512, "CPU_ATTN")
    plain = encode_handshake_reply(HandshakeReply(meta, {"layer.0": (b"m",)}))
    assert "kv_format" not in msgpack.unpackb(plain[0])  # upstream's metadata map
    assert decode_handshake_reply(*plain).metadata.kv_format is None
    fmt = {"layout": "cpu_blocks", "dtype": "bfloat16", "block_size": 128}
    rich = encode_handshake_reply(
        HandshakeReply(
            AgentMetadata("P", b"desc", (4096,), 16, 512, "CPU_ATTN", kv_format=fmt),
            {"layer.0": (b"m",)},
        )
    )
    assert dict(decode_handshake_reply(*rich).metadata.kv_format) == fmt
    for bad in (
        [1, 2],
        {"layout": 1.5},
        {"x" * 600: 1},
        {"layout": [1, 2]},
        {str(i): 1 for i in range(40)},
    ):
        data = msgpack.unpackb(plain[0])
        data["kv_format"] = bad
        with pytest.raises(WireDecodeError, match="kv_format"):
            decode_handshake_reply(msgpack.packb(data), plain[1])
