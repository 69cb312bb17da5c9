"""NixlEngine against hostile and careless callers: wrong types, forged or tampered descriptors, deregistered
memory, a restarted peer, use after close. Every refusal names what was wrong; nothing reaches memory it should not.
"""

import msgspec
import pytest
import torch

from moriio_fsm.engines import StatusCode
from moriio_fsm.engines.nixl import NixlEngineDesc

WAIT_MS = 10_000


@pytest.mark.parametrize(
    "bad, error", [(b"\x00garbage", ValueError), ("text", TypeError), (None, TypeError)]
)
def test_descriptors_unpack_only_from_their_own_bytes(nixl_pair, bad, error):
    with pytest.raises(error, match="descriptor"):
        nixl_pair.producer.unpack_engine_desc(bad)
    with pytest.raises(error, match="descriptor"):
        nixl_pair.producer.unpack_memory_desc(bad)
    # One kind's bytes are not the other's.
    with pytest.raises(ValueError, match="NixlMemoryDesc"):
        nixl_pair.producer.unpack_memory_desc(nixl_pair.consumer.get_engine_desc().pack())


def test_calls_with_the_wrong_descriptor_type_raise_type_error(nixl_pair):
    engine = nixl_pair.producer
    with pytest.raises(TypeError, match="NixlEngineDesc"):
        engine.register_remote_engine(nixl_pair.remote_mem)
    with pytest.raises(TypeError, match="NixlEngineDesc"):
        engine.deregister_remote_engine(b"bytes")
    with pytest.raises(TypeError, match="NixlMemoryDesc"):
        engine.create_session(nixl_pair.source_mem, nixl_pair.remote_mem.pack())
    with pytest.raises(TypeError, match="NixlMemoryDesc"):
        engine.deregister_memory(None)
    with pytest.raises(TypeError, match="torch.Tensor"):
        engine.register_torch_tensor(bytearray(16))


def test_tensors_that_cannot_be_registered_are_refused_saying_why(nixl_pair):
    with pytest.raises(ValueError, match="empty"):
        nixl_pair.producer.register_torch_tensor(torch.zeros(0))
    with pytest.raises(ValueError, match="contiguous"):
        nixl_pair.producer.register_torch_tensor(torch.zeros(4, 4)[:, 1])


def test_metadata_of_another_agent_under_a_key_is_refused(nixl_pair, nixl_engine):
    third = nixl_engine("nixl-third")
    forged = NixlEngineDesc(
        key="nixl-somebody", agent_metadata=third.get_engine_desc().agent_metadata
    )
    with pytest.raises(ValueError, match="'nixl-somebody'.*'nixl-third'"):
        nixl_pair.producer.register_remote_engine(forged)
    with pytest.raises(ValueError, match="refused the metadata"):
        nixl_pair.producer.register_remote_engine(
            NixlEngineDesc(key="nixl-junk", agent_metadata=b"junk")
        )


def test_a_descriptor_tampered_past_the_registered_region_moves_nothing(nixl_pair):
    """NIXL checks remote ranges against what the owner registered: a shifted address reaches nothing."""
    tampered = msgspec.structs.replace(
        nixl_pair.remote_mem, address=nixl_pair.remote_mem.address + (1 << 30)
    )
    session = nixl_pair.producer.create_session(nixl_pair.source_mem, tampered)
    assert session is not None  # the metadata itself is genuine
    status = session.write(0, 0, 64, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_NOT_FOUND, status
    assert "NIXL refused" in status.message()
    assert int(nixl_pair.target.count_nonzero()) == 0
    # A larger size than registered is caught before NIXL: the descriptor's size bounds every range.
    grown = msgspec.structs.replace(nixl_pair.remote_mem, size=nixl_pair.remote_mem.size * 2)
    status = nixl_pair.producer.create_session(nixl_pair.source_mem, grown).write(
        0, 4096, 64, nixl_pair.session.allocate_transfer_uid()
    )
    assert status.wait_for(WAIT_MS) and status.failed()
    assert int(nixl_pair.target.count_nonzero()) == 0


def test_memory_without_metadata_gets_no_session(nixl_pair):
    bare = msgspec.structs.replace(
        nixl_pair.remote_mem, mem_id=nixl_pair.remote_mem.mem_id + 100, metadata=b""
    )
    assert nixl_pair.producer.create_session(nixl_pair.source_mem, bare) is None


def test_another_engines_memory_is_not_a_local_region(nixl_pair):
    assert nixl_pair.producer.create_session(nixl_pair.remote_mem, nixl_pair.remote_mem) is None


def test_deregistered_local_memory_fails_later_transfers(nixl_pair):
    nixl_pair.producer.deregister_memory(nixl_pair.source_mem)
    nixl_pair.producer.deregister_memory(nixl_pair.source_mem)  # again: ignored
    assert not nixl_pair.session.alive()
    status = nixl_pair.session.write(0, 0, 64, nixl_pair.session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.code() == StatusCode.ERR_RDMA_OP
    assert "deregistered" in status.message()
    assert int(nixl_pair.target.count_nonzero()) == 0
    with pytest.raises(ValueError, match="belongs to engine"):
        nixl_pair.producer.deregister_memory(nixl_pair.remote_mem)


def test_a_restarted_peer_replaces_the_old_one(nixl_pair, nixl_engine):
    old_session = nixl_pair.session
    nixl_pair.consumer.close()
    restarted = nixl_engine("nixl-d")  # same key, new agent
    target = torch.zeros(4096, dtype=torch.uint8)
    memory = restarted.register_torch_tensor(target)
    nixl_pair.producer.register_remote_engine(
        nixl_pair.producer.unpack_engine_desc(restarted.get_engine_desc().pack())
    )
    assert not old_session.alive()
    late = old_session.write(0, 0, 64, old_session.allocate_transfer_uid())
    assert late.wait_for(WAIT_MS) and late.code() == StatusCode.ERR_RDMA_OP
    session = nixl_pair.producer.create_session(
        nixl_pair.source_mem, nixl_pair.producer.unpack_memory_desc(memory.pack())
    )
    status = session.write(0, 128, 256, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert torch.equal(target[128:384], nixl_pair.source[:256])


def test_a_session_into_the_engines_own_memory_copies_locally(nixl_pair):
    engine = nixl_pair.producer
    scratch = torch.zeros(1024, dtype=torch.uint8)
    session = engine.create_session(engine.register_torch_tensor(scratch), nixl_pair.source_mem)
    status = session.read(0, 100, 500, session.allocate_transfer_uid())
    assert status.wait_for(WAIT_MS) and status.succeeded(), status.message()
    assert torch.equal(scratch[:500], nixl_pair.source[100:600])


def test_after_close_posts_fail_and_registration_raises(nixl_pair):
    engine, session = nixl_pair.producer, nixl_pair.session
    engine.close()
    engine.close()  # idempotent
    status = session.write(0, 0, 64, session.allocate_transfer_uid())
    assert status.code() == StatusCode.ERR_BAD_STATE and "closed" in status.message()
    assert engine.create_session(nixl_pair.source_mem, nixl_pair.remote_mem) is None
    with pytest.raises(RuntimeError, match="closed"):
        engine.register_torch_tensor(torch.zeros(8))
    assert not session.alive()


def test_close_ends_every_transfer_in_flight(nixl_pair, nixl_engine):
    big = torch.ones(16 << 20, dtype=torch.uint8)
    engine, peer = nixl_pair.producer, nixl_pair.consumer
    session = engine.create_session(
        engine.register_torch_tensor(big),
        engine.unpack_memory_desc(
            peer.register_torch_tensor(torch.zeros(16 << 20, dtype=torch.uint8)).pack()
        ),
    )
    statuses = [session.write(0, 0, 16 << 20, session.allocate_transfer_uid()) for _ in range(20)]
    engine.close()
    assert all(s.wait_for(WAIT_MS) for s in statuses)
    assert all(s.succeeded() or s.code() == StatusCode.ERR_BAD_STATE for s in statuses)


@pytest.mark.parametrize(
    "options, named",
    [
        ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
        ({"idle_progress_s": -1}, "idle_progress_s"),
        ({"deregister_wait_s": "10"}, "deregister_wait_s"),
        ({"min_poll_s": True}, "min_poll_s"),
    ],
)
def test_engine_options_are_checked(nixl_engine, options, named):
    with pytest.raises(ValueError, match=named):
        nixl_engine("nixl-options", **options)


def test_engine_keys_must_be_non_empty_strings(nixl_engine):
    with pytest.raises(ValueError, match="engine key"):
        nixl_engine("")
    with pytest.raises(ValueError, match="engine key"):
        nixl_engine(None)


def test_a_ucx_setting_that_leaves_no_transport_stops_the_start_naming_it(nixl_engine, monkeypatch):
    from moriio_fsm.engines.nixl import NixlUnavailableError

    monkeypatch.setenv("UCX_TLS", "tcp,self,sm")  # restored after the override below rewrites it
    with pytest.raises(NixlUnavailableError, match="UCX_TLS=no_such_transport"):
        nixl_engine("nixl-no-transport", ucx={"UCX_TLS": "no_such_transport"})
