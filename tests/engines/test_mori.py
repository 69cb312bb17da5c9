"""MoriEngine's own promises, checked against a recording stand-in for the mori.io module.

Rules: the stand-in imitates only mori.io's Python surface, so these tests show what MoriEngine sends to mori
and what it refuses to send; the contract suite covers real transfers where mori.io imports.
"""

import gc
import sys
import types
import weakref

import pytest
import torch

from moriio_fsm.engines import MoriEngine, MoriUnavailableError, StatusCode, probe_mori
from moriio_fsm.engines import mori


class RecordedStatus:
    def __init__(self, session):
        self.session = session
        self.code = 2  # IN_PROGRESS: completion arrives later

    def _query(self):
        self.session.queries += 1
        return self.code

    def Code(self): return self._query()
    def Message(self): return "" if self.code < 11 else "remote error"
    def Init(self): return self._query() == 1
    def InProgress(self): return self._query() == 2
    def Succeeded(self): return self._query() == 0
    def Failed(self): return self._query() > 10
    def Wait(self): pass
    def WaitFor(self, timeout_ms=-1): pass


class RecordedSession:
    def __init__(self, calls):
        self.calls = calls
        self.raw_statuses = []
        self.queries = 0  # native status queries, counted across all statuses

    def allocate_transfer_uid(self): return 7

    def _post(self, op, *args):
        self.calls.append((op, args))
        status = RecordedStatus(self)
        self.raw_statuses.append(status)
        return status

    def batch_write(self, *args): return self._post("batch_write", *args)
    def batch_read(self, *args): return self._post("batch_read", *args)
    def alive(self): return True


def fake_mori_io():
    calls = []
    io = types.ModuleType("mori.io")

    class MemoryDesc:
        def __init__(self, engine_key, size):
            self.engine_key, self.size = engine_key, size

        def pack(self): return f"{self.engine_key}:{self.size}".encode()

        @staticmethod
        def unpack(data):
            key, size = data.decode().split(":")
            return MemoryDesc(key, int(size))

    class EngineDesc:
        def __init__(self, key): self.key = key
        def pack(self): return self.key.encode()

        @staticmethod
        def unpack(data): return EngineDesc(data.decode())

    class IOEngine:
        def __init__(self, key, config):
            self.key = key
            calls.append(("IOEngine", (key, config)))

        def create_backend(self, kind, config): calls.append(("create_backend", (kind, config)))
        def get_engine_desc(self): return EngineDesc(self.key)
        def register_remote_engine(self, desc): calls.append(("register_remote_engine", (desc,)))
        def deregister_remote_engine(self, desc): calls.append(("deregister_remote_engine", (desc,)))

        def register_torch_tensor(self, tensor):
            return MemoryDesc(self.key, tensor.numel() * tensor.element_size())

        def deregister_memory(self, mem): calls.append(("deregister_memory", (mem,)))
        def allocate_transfer_uid(self): return 1

        def create_session(self, local, remote):
            io.session = RecordedSession(calls)
            return io.session

    io.IOEngine, io.EngineDesc, io.MemoryDesc = IOEngine, EngineDesc, MemoryDesc
    io.IOEngineConfig = lambda host, port: ("config", host, port)
    io.RdmaBackendConfig = lambda *args: ("rdma", args)
    io.BackendType = types.SimpleNamespace(RDMA="RDMA")
    io.PollCqMode = types.SimpleNamespace(POLLING="POLLING", EVENT="EVENT")
    io.calls = calls
    return io


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(probe_mori, "_result", None)
    yield
    # Later tests must probe the real environment again, not this test's fake.
    probe_mori.forget()


@pytest.fixture
def fake_io(monkeypatch, fresh_probe):
    io = fake_mori_io()
    package = types.ModuleType("mori")
    package.io = io
    monkeypatch.setitem(sys.modules, "mori", package)
    monkeypatch.setitem(sys.modules, "mori.io", io)
    return io


@pytest.fixture
def session(fake_io):
    engine = MoriEngine("prefill", "127.0.0.1", 5555)
    local = engine.register_torch_tensor(torch.zeros(1024, dtype=torch.uint8))
    remote = engine.unpack_memory_desc(b"decode:2048")
    made = engine.create_session(local, remote)
    made.engine = engine
    return made


def test_a_missing_package_is_reported_not_raised(monkeypatch, fresh_probe):
    monkeypatch.setitem(sys.modules, "mori", None)
    monkeypatch.setitem(sys.modules, "mori.io", None)
    availability = probe_mori()
    assert not availability.available and "not installed" in availability.reason
    with pytest.raises(MoriUnavailableError, match="not installed"):
        MoriEngine("prefill")


def test_a_failed_native_load_is_reported_not_raised(monkeypatch, fresh_probe):
    def broken_import(name):
        raise OSError("libhsa-runtime64.so.1: cannot open shared object file")

    monkeypatch.setattr(mori.importlib, "import_module", broken_import)
    availability = probe_mori()
    assert not availability.available
    assert "native libraries" in availability.reason and "libhsa" in availability.reason


@pytest.mark.parametrize("error", [RuntimeError("HIP runtime version mismatch"),
                                   AttributeError("module 'torch' has no attribute 'hip'"),
                                   SystemError("initialization of _mori failed")])
def test_any_exception_while_importing_is_reported_not_raised(monkeypatch, fresh_probe, error):
    def broken_import(name):
        raise error

    monkeypatch.setattr(mori.importlib, "import_module", broken_import)
    availability = probe_mori()
    assert not availability.available
    assert type(error).__name__ in availability.reason and str(error) in availability.reason
    with pytest.raises(MoriUnavailableError, match=type(error).__name__):
        MoriEngine("prefill")


def test_configuration_reaches_mori_as_an_rdma_backend(fake_io):
    MoriEngine("prefill", "10.0.0.1", 7000, qp_per_transfer=2, poll_cq_mode="event")
    assert fake_io.calls[0] == ("IOEngine", ("prefill", ("config", "10.0.0.1", 7000)))
    kind, config = fake_io.calls[1][1]
    assert kind == "RDMA" and config == ("rdma", (2, -1, -1, "EVENT", True))


@pytest.mark.parametrize(
    "kwargs, named",
    [({"port": 70000}, "port"), ({"qp_per_transfer": 0}, "qp_per_transfer"),
     ({"poll_cq_mode": "busy"}, "poll_cq_mode"), ({"num_worker_threads": 0}, "num_worker_threads")],
)
def test_bad_configuration_is_refused_before_mori_is_called(fake_io, kwargs, named):
    with pytest.raises(ValueError, match=named):
        MoriEngine("prefill", **kwargs)
    assert fake_io.calls == []


def test_valid_batches_reach_mori_as_plain_int_lists(session, fake_io):
    status = session.batch_write((0, 512), [1024, 0], [512, 512], 9)
    assert status.in_progress()
    assert fake_io.calls[-1] == ("batch_write", ([0, 512], [1024, 0], [512, 512], 9))


@pytest.mark.parametrize(
    "args",
    [([0], [2040], [16], 1), ([0], [0], [0], 1), ([-1], [0], [8], 1), ([0, 8], [0], [8, 8], 1), ([0], [0], [8], -3)],
)
def test_bad_batches_never_reach_mori(session, fake_io, args):
    before = len(fake_io.calls)
    status = session.batch_read(*args)
    assert status.code() == StatusCode.ERR_INVALID_ARGS
    assert len(fake_io.calls) == before


def test_unregistered_tensor_kinds_are_refused_before_mori(fake_io):
    engine = MoriEngine("prefill")
    with pytest.raises(ValueError, match="contiguous"):
        engine.register_torch_tensor(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="mori MemoryDesc"):
        engine.create_session(object(), object())


def test_in_flight_statuses_stay_referenced_until_final(session, fake_io):
    for i in range(3):
        session.batch_write([i * 8], [i * 8], [8], i)
    raws = list(fake_io.session.raw_statuses)
    watchers = [weakref.ref(raw) for raw in raws]
    fake_io.session.raw_statuses.clear()
    del raws
    gc.collect()
    assert all(w() is not None for w in watchers)
    assert session.engine.in_flight_count == 3
    watchers[0]().code = 0
    watchers[1]().code = 13
    assert session.engine.in_flight_count == 1
    gc.collect()
    assert watchers[0]() is None and watchers[1]() is None and watchers[2]() is not None


def test_status_wrapper_reports_mori_codes(session, fake_io):
    status = session.batch_write([0], [0], [8], 1)
    fake_io.session.raw_statuses[-1].code = 13
    assert status.failed() and not status.succeeded()
    assert status.code() == StatusCode.ERR_RDMA_OP and status.message() == "remote error"
    assert status.wait_for(10)


def test_posting_queries_a_bounded_number_of_statuses_however_many_are_in_flight(session, fake_io):
    posts = 3000
    for i in range(posts):
        session.batch_write([0], [0], [8], i)
    # Re-checking every live status on every post would cost about posts**2 / 2 queries.
    assert fake_io.session.queries <= 3 * posts
    assert session.engine.in_flight_count == posts


def test_final_statuses_are_released_while_in_flight_ones_stay_referenced(session, fake_io):
    finished, in_flight = [], []
    for i in range(2000):
        session.batch_write([0], [0], [8], i)
        raw = fake_io.session.raw_statuses.pop()
        if i % 10 == 0:
            in_flight.append(weakref.ref(raw))
        else:
            raw.code = 0 if i % 3 else 13
            finished.append(weakref.ref(raw))
        del raw
    gc.collect()
    assert all(w() is not None for w in in_flight)
    # Pruning when the list doubles keeps at most about twice the live count.
    assert sum(w() is not None for w in finished) <= 2 * len(in_flight) + 64
    assert session.engine.in_flight_count == len(in_flight)
