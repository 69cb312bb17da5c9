"""The engine contract: what the state machines rely on, checked against every engine.

Runs once per engine kind; NixlEngine is skipped with the reason where nixl does not import; MoriEngine runs
through mori.io, the real one or else the pinned amd-mori wheel's own Python layer over the stand-in ``mori.cpp``,
and is skipped only where pip cannot fetch that wheel.
"""

import pytest
import torch

from moriio_fsm.engines import StatusCode

WAIT_MS = 10_000


def test_engine_descriptor_survives_packing(pair):
    desc = pair.consumer.get_engine_desc()
    packed = desc.pack()
    assert isinstance(packed, bytes)
    assert pair.producer.unpack_engine_desc(packed).key == pair.consumer.key


def test_memory_descriptor_survives_packing_and_reports_region_size(pair):
    unpacked = pair.producer.unpack_memory_desc(pair.target_mem.pack())
    assert unpacked.engine_key == pair.consumer.key
    assert unpacked.size == pair.target.numel() * pair.target.element_size()


def test_batch_write_lands_every_range_and_returns_one_status(pair):
    status = pair.session.batch_write(
        [0, 100, 2000], [3000, 10, 500], [64, 200, 1000], pair.session.allocate_transfer_uid()
    )
    assert status.wait_for(WAIT_MS)
    assert status.succeeded() and not status.failed()
    assert status.code() == StatusCode.SUCCESS
    assert torch.equal(pair.target[3000:3064], pair.source[0:64])
    assert torch.equal(pair.target[10:210], pair.source[100:300])
    assert torch.equal(pair.target[500:1500], pair.source[2000:3000])
    untouched = torch.ones(pair.target.numel(), dtype=torch.bool)
    for start, size in ((3000, 64), (10, 200), (500, 1000)):
        untouched[start : start + size] = False
    assert int(pair.target[untouched].count_nonzero()) == 0


def test_batch_read_pulls_remote_ranges_into_local_memory(pair):
    pair.target[:] = (
        torch.arange(pair.target.numel(), dtype=torch.int64).remainder(251).to(torch.uint8)
    )
    expected_head = pair.target[1024:1536].clone()
    status = pair.session.batch_read(
        [0, 512], [1024, 4000], [512, 96], pair.session.allocate_transfer_uid()
    )
    assert status.wait_for(WAIT_MS) and status.succeeded()
    assert torch.equal(pair.source[0:512], expected_head)
    assert torch.equal(pair.source[512:608], pair.target[4000:4096])


def test_single_write_and_read(pair):
    write = pair.session.write(8, 16, 32, pair.session.allocate_transfer_uid())
    assert write.wait_for(WAIT_MS) and write.succeeded()
    assert torch.equal(pair.target[16:48], pair.source[8:40])
    pair.target[100:110] = 7
    read = pair.session.read(0, 100, 10, pair.session.allocate_transfer_uid())
    assert read.wait_for(WAIT_MS) and read.succeeded()
    assert pair.source[0:10].tolist() == [7] * 10


def test_wait_all_and_wait_see_every_status_final(pair):
    statuses = [
        pair.session.batch_write([i * 64], [i * 64], [64], pair.session.allocate_transfer_uid())
        for i in range(16)
    ]
    assert pair.producer.wait_all(statuses, WAIT_MS)
    assert all(s.wait() == StatusCode.SUCCESS for s in statuses)
    assert torch.equal(pair.target[:1024], pair.source[:1024])


def test_transfer_uids_are_distinct(pair):
    uids = {pair.producer.allocate_transfer_uid() for _ in range(100)}
    uids |= {pair.session.allocate_transfer_uid() for _ in range(100)}
    assert len(uids) == 200


@pytest.mark.parametrize(
    "local_offsets, remote_offsets, sizes, uid, named",
    [
        ([0, 64], [0], [64, 64], 1, "equal lengths"),
        ([], [], [], 1, "empty batch"),
        ([0], [0], [0], 1, "sizes[0]"),
        ([-8], [0], [8], 1, "local_offsets[0]"),
        ([0], [-8], [8], 1, "remote_offsets[0]"),
        ([4090], [0], [64], 1, "local range 0"),
        ([0, 0], [0, 4095], [8, 2], 1, "remote range 1"),
        ([0], [0], [8], -1, "transfer_uid"),
    ],
)
def test_bad_argument_values_come_back_as_failed_status_and_move_nothing(
    pair, local_offsets, remote_offsets, sizes, uid, named
):
    status = pair.session.batch_write(local_offsets, remote_offsets, sizes, uid)
    assert status.failed() and not status.in_progress()
    assert status.code() == StatusCode.ERR_INVALID_ARGS
    assert named in status.message()
    assert int(pair.target.count_nonzero()) == 0


@pytest.mark.parametrize(
    "args, named",
    [
        (([0.5], [0], [8], 1), "local_offsets"),
        (([0], "0", [8], 1), "remote_offsets"),
        (([0], [0], None, 1), "sizes"),
        (([0], [0], [8], "uid"), "transfer_uid"),
        (([0], [0], [8], True), "transfer_uid"),
        (([0, 8], [0, "8"], [8, 8], 1), r"remote_offsets\[1\]"),
    ],
)
def test_arguments_of_the_wrong_type_raise_type_error_naming_them(pair, args, named):
    with pytest.raises(TypeError, match=named):
        pair.session.batch_write(*args)


def test_single_transfers_name_the_argument_that_is_not_an_integer(pair):
    with pytest.raises(TypeError, match="size must be an integer"):
        pair.session.write(0, 0, 8.0, pair.session.allocate_transfer_uid())
    with pytest.raises(TypeError, match="remote_offset must be an integer"):
        pair.session.read(0, False, 8, pair.session.allocate_transfer_uid())


def test_registering_a_non_contiguous_tensor_is_refused(pair):
    with pytest.raises(ValueError, match="contiguous"):
        pair.producer.register_torch_tensor(torch.zeros(8, 8, dtype=torch.uint8).t())


def test_a_session_to_an_unregistered_engine_is_not_created(pair):
    pair.producer.deregister_remote_engine(pair.consumer.get_engine_desc())
    assert pair.producer.create_session(pair.source_mem, pair.remote_mem) is None


def test_sessions_report_alive(pair):
    assert pair.session.alive()
