"""LoopbackEngine lets go of shared memory as soon as nothing can use it, not only at close.

Each test watches this process's region fds and mappings through the conftest
leak check while the engine is still open.
"""

import torch

from moriio_fsm.engines import LoopbackEngine

WAIT_MS = 10_000


def test_a_deregistered_shared_tensor_is_released_while_the_engine_is_open(region_leak_check):
    check = region_leak_check()
    with LoopbackEngine("releasing") as engine:
        tensor = engine.allocate_shared_tensor(4096)
        mem = engine.register_torch_tensor(tensor[1024:])
        del tensor
        assert check.leaked(), "the registration must keep the memory valid"
        engine.deregister_memory(mem)
        assert check.leaked() == []


def test_shared_tensors_dropped_without_registering_are_released(region_leak_check):
    check = region_leak_check()
    with LoopbackEngine("churning") as engine:
        for _ in range(20):
            engine.allocate_shared_tensor(1 << 16).fill_(1)
        kept = engine.allocate_shared_tensor(64)
        tokens = {handle.rsplit("moriio-loopback-", 1)[1] for handle in check.leaked()}
        assert len(tokens) == 1, tokens  # only the kept tensor's region
        del kept
        assert check.leaked() == []


def test_registered_memory_stays_valid_after_the_caller_drops_its_tensor():
    with LoopbackEngine("owner") as owner, LoopbackEngine("writer") as writer:
        target_mem = owner.register_torch_tensor(owner.allocate_shared_tensor(4096))
        writer.register_remote_engine(owner.get_engine_desc())
        source = torch.arange(256, dtype=torch.int64).to(torch.uint8)
        back = torch.zeros(256, dtype=torch.uint8)
        session = writer.create_session(writer.register_torch_tensor(source), target_mem)
        assert session.write(0, 100, 256, 1).wait_for(WAIT_MS)
        reader = writer.create_session(writer.register_torch_tensor(back), target_mem)
        read = reader.read(0, 100, 256, 2)
        assert read.wait_for(WAIT_MS) and read.succeeded()
        assert torch.equal(back, source)
