"""The stand-in ``mori.cpp`` is as strict as mori's pybind11 bindings: argument counts, keywords, C++ types and
ranges, bytes-only unpack, enum identity, and ``TransferStatus``'s rules.

Rules: every case here is one pybind11 or mori's C++ would refuse (or allow) the same way; a case that passes a
value through must show the value arrived, not just that nothing raised.
"""

import copy
import pickle
import sys

import pytest
import torch


@pytest.fixture
def cpp(standin):
    return sys.modules["mori.cpp"]


@pytest.mark.parametrize(
    "make",
    [
        lambda c: c.IOEngineConfig("h", 65536),  # uint16 overflow
        lambda c: c.IOEngineConfig("h", -1),
        lambda c: c.IOEngineConfig("h", 80.0),  # a float is never an int
        lambda c: c.IOEngineConfig(7, 80),  # an int is not a std::string
        lambda c: c.IOEngineConfig("h", 80, 1),  # one argument too many
        lambda c: c.IOEngineConfig(hostname="h"),  # no such keyword
        lambda c: c.RdmaBackendConfig(1, -1, -1, 0),  # an int is not a PollCqMode
        lambda c: c.RdmaBackendConfig(qp_per_transfer=1 << 31),  # C++ int overflow
        lambda c: c.RdmaBackendConfig(notif_per_qp=-1),  # uint32
        lambda c: c.RdmaBackendConfig(
            enable_notification="yes"
        ),  # a str has no numeric truth value
        lambda c: c.XgmiBackendConfig(num_streams="64"),
        lambda c: c.TransferStatus().WaitFor(1 << 31),  # WaitFor takes a C++ int
        lambda c: c.TransferStatus().WaitFor(1.5),
        lambda c: c.TransferStatus().Update(11, "x"),  # an int is not a StatusCode
        lambda c: c.TransferStatus().Update(
            code=c.StatusCode.ERR_RDMA_OP, message="x"
        ),  # no py::arg names
        lambda c: c.TransferStatus().SetCode(c.BackendType.RDMA),  # another enum
        lambda c: c.TransferStatus(1),
    ],
)
def test_calls_pybind_would_refuse_raise_type_error(cpp, make):
    with pytest.raises(TypeError, match="incompatible (function|constructor) arguments"):
        make(cpp)


def test_values_pybind_converts_arrive_converted(cpp):
    config = cpp.IOEngineConfig(b"10.0.0.1", port=True)  # bytes -> str, bool is an int to pybind
    assert (config.host, config.port) == ("10.0.0.1", 1)
    rdma = cpp.RdmaBackendConfig(enable_notification=0, chunk_bytes=torch.tensor(4096).item())
    assert rdma.enable_notification is False and rdma.chunk_bytes == 4096
    assert cpp.TransferStatus().WaitFor(timeout_ms=0) == cpp.StatusCode.INIT


def test_read_write_fields_convert_what_is_assigned_and_read_only_ones_refuse(cpp):
    config = cpp.RdmaBackendConfig()
    config.qp_per_transfer = 4
    assert config.qp_per_transfer == 4
    with pytest.raises(TypeError):
        config.qp_per_transfer = 2.5
    with pytest.raises(TypeError):
        cpp.IOEngineConfig().port = 1 << 16
    desc = cpp.MemoryDesc()
    with pytest.raises(AttributeError):
        desc.size = 8
    with pytest.raises(AttributeError):
        desc.anything = 1  # pybind objects take no new attributes


def test_the_defaults_are_mori_bindings_defaults(cpp):
    rdma = cpp.RdmaBackendConfig()
    assert (rdma.qp_per_transfer, rdma.post_batch_size, rdma.num_worker_threads) == (1, -1, -1)
    assert rdma.poll_cq_mode == cpp.PollCqMode.POLLING and rdma.enable_notification is True
    assert (rdma.notif_per_qp, rdma.chunk_bytes, rdma.max_chunks_per_transfer) == (1024, 65536, 64)
    assert (cpp.XgmiBackendConfig().num_streams, cpp.XgmiBackendConfig().num_events) == (64, 64)
    config = cpp.IOEngineConfig()
    assert (config.host, config.port) == ("", 0)


class TestEnums:
    def test_members_are_singletons_but_values_from_calls_are_new_objects(self, cpp):
        status = cpp.TransferStatus()
        code = status.Code()
        assert code == cpp.StatusCode.INIT and code is not cpp.StatusCode.INIT
        assert (
            cpp.StatusCode(0) == cpp.StatusCode.SUCCESS
            and cpp.StatusCode(0) is not cpp.StatusCode.SUCCESS
        )
        assert cpp.BackendType.RDMA is cpp.BackendType.RDMA

    def test_a_scoped_enum_never_equals_an_int_or_another_enum(self, cpp):
        assert cpp.StatusCode.SUCCESS != 0 and not cpp.StatusCode.SUCCESS == 0
        assert cpp.BackendType.XGMI != cpp.MemoryLocationType.CPU  # both have the value 1
        assert int(cpp.StatusCode.ERR_RDMA_OP) == 13 and [10, 20][cpp.StatusCode.INIT] == 20
        with pytest.raises(TypeError):
            _ = cpp.StatusCode.SUCCESS < cpp.StatusCode.INIT

    def test_export_values_puts_three_enums_at_module_level(self, cpp):
        assert cpp.ERR_RDMA_OP == cpp.StatusCode.ERR_RDMA_OP and cpp.RDMA == cpp.BackendType.RDMA
        assert cpp.GPU == cpp.MemoryLocationType.GPU
        assert not hasattr(cpp, "POLLING") and not hasattr(cpp, "PEER_UNREACHABLE")

    def test_enums_show_and_list_themselves_as_pybind_does(self, cpp):
        assert repr(cpp.StatusCode.ERR_BAD_STATE) == "<StatusCode.ERR_BAD_STATE: 14>"
        assert str(cpp.PollCqMode.EVENT) == "PollCqMode.EVENT"
        assert list(cpp.StatusCode.__members__) == [
            "SUCCESS",
            "INIT",
            "IN_PROGRESS",
            "ERR_INVALID_ARGS",
            "ERR_NOT_FOUND",
            "ERR_RDMA_OP",
            "ERR_BAD_STATE",
            "ERR_GPU_OP",
        ]
        assert cpp.StatusCode(99).name == "???"


class TestTransferStatus:
    def test_a_failure_sticks_against_update_but_not_against_set_code(self, cpp):
        status = cpp.TransferStatus()
        status.Update(cpp.StatusCode.ERR_RDMA_OP, "first")
        status.Update(cpp.StatusCode.SUCCESS, "later")
        assert status.Failed() and status.Message() == "first"
        status.SetCode(cpp.StatusCode.SUCCESS)
        assert status.Succeeded() and status.Message() == "first"

    def test_a_success_is_not_sticky(self, cpp):
        status = cpp.TransferStatus()
        status.Update(cpp.StatusCode.SUCCESS, "")
        status.Update(cpp.StatusCode.ERR_RDMA_OP, "notification send failed")
        assert status.Failed() and status.Code() == cpp.StatusCode.ERR_RDMA_OP

    def test_wait_for_returns_at_once_unless_in_progress(self, cpp):
        status = cpp.TransferStatus()
        assert status.WaitFor(-1) == cpp.StatusCode.INIT  # a status never posted: no wait at all
        status.SetCode(cpp.StatusCode.IN_PROGRESS)
        assert status.WaitFor(0) == cpp.StatusCode.IN_PROGRESS
        assert status.WaitFor(1) == cpp.StatusCode.IN_PROGRESS
        status.Update(cpp.StatusCode.ERR_GPU_OP, "x")
        assert status.WaitFor(-1) == cpp.StatusCode.ERR_GPU_OP and status.Failed()

    def test_a_status_cannot_be_copied_or_pickled(self, cpp):
        status = cpp.TransferStatus()
        for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError):
                attempt(status)


class TestDescriptors:
    def test_unpack_takes_bytes_only(self, cpp):
        packed = cpp.MemoryDesc().pack()
        assert cpp.MemoryDesc.unpack(packed) == cpp.MemoryDesc()
        for wrong in (bytearray(packed), memoryview(packed), packed.decode("latin-1"), None):
            with pytest.raises(TypeError):
                cpp.MemoryDesc.unpack(wrong)

    @pytest.mark.parametrize(
        "garbage",
        [b"", b"\xc1", b"\x93\x01\x02", b"\x81\xa1k\x01", b"\x96\x01\x02\x03\x04\x05\x06"],
    )
    def test_bytes_that_are_not_a_descriptor_raise_runtime_error(self, cpp, garbage):
        with pytest.raises(RuntimeError):
            cpp.EngineDesc.unpack(garbage)

    def test_a_memory_descriptor_is_not_an_engine_descriptor(self, cpp):
        with pytest.raises(RuntimeError):
            cpp.EngineDesc.unpack(cpp.MemoryDesc().pack())

    def test_descriptors_survive_packing_compare_by_value_and_are_unhashable(self, cpp):
        engine = cpp.IOEngine("k", cpp.IOEngineConfig("127.0.0.1", 0))
        desc = engine.GetEngineDesc()
        again = cpp.EngineDesc.unpack(desc.pack())
        assert again == desc and again is not desc
        assert (again.key, again.host, again.port) == ("k", "127.0.0.1", 0)
        with pytest.raises(TypeError):
            hash(desc)
        with pytest.raises(TypeError, match="No constructor"):
            cpp.EngineDesc()

    def test_the_wire_format_is_mori_msgpack_array(self, cpp):
        import msgpack

        engine = cpp.IOEngine("k", cpp.IOEngineConfig("10.1.2.3", 5000))
        fields = msgpack.unpackb(engine.GetEngineDesc().pack())
        assert fields[0] == "k" and fields[3:5] == ["10.1.2.3", 5000] and len(fields) == 6
        memory = msgpack.unpackb(cpp.MemoryDesc().pack())
        assert len(memory) == 15 and memory[7] == bytes(64) and memory[2] == -1


def test_the_module_binds_what_mori_io_imports_and_says_it_is_a_stand_in(cpp, standin):
    imported_by_mori_io = {
        "IOEngineConfig",
        "StatusCode",
        "BackendType",
        "EngineDesc",
        "MemoryDesc",
        "MemoryLocationType",
        "PeerFailureEvent",
        "PeerFailureReason",
        "PollCqMode",
        "RdmaBackendConfig",
        "XgmiBackendConfig",
        "FabricBackendConfig",
        "fabric_alloc",
        "fabric_free",
        "set_log_level",
    }
    assert imported_by_mori_io | {"TransferStatus", "IOEngine", "IOEngineSession"} <= set(dir(cpp))
    assert cpp.__standin__ is True and "STAND-IN" in cpp.__doc__
    assert "stand-in" in repr(cpp.TransferStatus())
    with pytest.raises(RuntimeError, match="stand-in"):
        cpp.fabric_alloc(4096, 0)
