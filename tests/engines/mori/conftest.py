"""Fixtures for MoriEngine's and the mori stand-in's own tests: mori.io loaded from the pinned wheel over the
stand-in ``mori.cpp``, a pair of raw mori engines, and a pair of MoriEngines.

Rules: a test that needs the stand-in is skipped where a real mori.io imports (it then has nothing to drive) or
pip cannot fetch the wheel; after each test the stand-in's fault rules are cleared, its host has its RDMA device
back, and a test fails if the stand-in recorded an incident (a status written after Python freed it) it did not
take itself.
"""

import pytest
import torch

from moriio_fsm.engines import mori_standin


@pytest.fixture
def standin(mori_io):
    """The stand-in package, loaded; reset after the test."""
    if not mori_standin.is_loaded():
        pytest.skip("a real mori.io imports here; these tests drive the stand-in")
    mori_standin.incidents.take()
    yield mori_standin
    assert mori_standin.drain(), "the stand-in's transfer thread did not finish its work"
    mori_standin.FAULTS.clear()
    mori_standin.HOST.rdma_device = True
    left = mori_standin.incidents.take()
    assert not left, f"the stand-in saw undefined behaviour: {left}"


class RawPair:
    """Two raw ``mori.io`` engines (RDMA, notifications as asked) with a registered host tensor each."""

    def __init__(self, io, size: int = 4096, notifications: bool = False):
        self.io = io
        self.producer = self._engine("raw-producer", notifications)
        self.consumer = self._engine("raw-consumer", notifications)
        self.producer.register_remote_engine(
            io.EngineDesc.unpack(self.consumer.get_engine_desc().pack())
        )
        self.source = torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8) + 1
        self.target = torch.zeros(size, dtype=torch.uint8)
        self.source_mem = self.producer.register_torch_tensor(self.source)
        self.target_mem = self.consumer.register_torch_tensor(self.target)
        self.remote_mem = io.MemoryDesc.unpack(self.target_mem.pack())
        self.session = self.producer.create_session(self.source_mem, self.remote_mem)
        assert self.session is not None

    def _engine(self, key, notifications):
        io = self.io
        engine = io.IOEngine(key, io.IOEngineConfig("127.0.0.1", 0))
        engine.create_backend(
            io.BackendType.RDMA, io.RdmaBackendConfig(enable_notification=notifications)
        )
        return engine

    def write(self, local_offsets, remote_offsets, sizes):
        return self.session.batch_write(
            local_offsets, remote_offsets, sizes, self.session.allocate_transfer_uid()
        )


@pytest.fixture
def make_raw_pair(standin, mori_io):
    """``make_raw_pair(notifications=False)``: a fresh ``RawPair``; their tensors outlive every transfer."""
    made = []
    yield lambda **options: made.append(RawPair(mori_io, **options)) or made[-1]
    mori_standin.drain()


@pytest.fixture
def raw_pair(make_raw_pair):
    return make_raw_pair()


class EnginePair:
    """Two MoriEngines that know each other, with a registered tensor each and a session between them."""

    def __init__(self, size: int = 4096, **options):
        from moriio_fsm.engines import MoriEngine

        self.producer = MoriEngine("mori-p", "127.0.0.1", 0, **options)
        self.consumer = MoriEngine("mori-d", "127.0.0.1", 0, **options)
        self.producer.register_remote_engine(
            self.producer.unpack_engine_desc(self.consumer.get_engine_desc().pack())
        )
        self.source = torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8) + 1
        self.target = torch.zeros(size, dtype=torch.uint8)
        self.source_mem = self.producer.register_torch_tensor(self.source)
        self.target_mem = self.consumer.register_torch_tensor(self.target)
        self.remote_mem = self.producer.unpack_memory_desc(self.target_mem.pack())
        self.session = self.producer.create_session(self.source_mem, self.remote_mem)
        assert self.session is not None

    def write(self, local_offsets, remote_offsets, sizes):
        return self.session.batch_write(
            local_offsets, remote_offsets, sizes, self.session.allocate_transfer_uid()
        )

    def close(self):
        mori_standin.drain()  # no transfer may touch the tensors once they go
        for engine in (self.producer, getattr(self, "consumer", None)):
            if engine is not None:
                engine.close()


@pytest.fixture
def engine_pair(standin):
    made = EnginePair()
    yield made
    made.close()
