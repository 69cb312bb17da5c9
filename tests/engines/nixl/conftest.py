"""Fixtures for the NIXL engine's own tests: a pair of engines in this process, and no engine thread left after.

Rules: each fixture closes what it opens; a test that needs nixl is skipped with the probe's reason only where
nixl does not import (CI installs it, so there they run).
"""

import threading

import pytest
import torch

from moriio_fsm.engines.nixl import probe_nixl


@pytest.fixture(autouse=True)
def no_leaked_engine_threads():
    yield
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("nixl-")]
    assert not leaked, f"NIXL engine threads still running after the test: {leaked}"


@pytest.fixture
def nixl_engine():
    """A factory of NixlEngines on 127.0.0.1, all closed after the test."""
    availability = probe_nixl()
    if not availability.available:
        pytest.skip(f"NixlEngine not tested: {availability.reason}")
    from moriio_fsm.engines.nixl import NixlEngine

    made = []

    def make(key, **options):
        engine = NixlEngine(key, "127.0.0.1", **options)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


class NixlPair:
    def __init__(self, make, size=4096):
        self.producer, self.consumer = make("nixl-p"), make("nixl-d")
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


@pytest.fixture
def nixl_pair(nixl_engine):
    return NixlPair(nixl_engine)
