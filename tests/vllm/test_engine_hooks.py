"""What the worker asks of an engine goes through the hooks the engine interface declares: fault rules where the
engine takes them (a clear error where it does not), and stopping a transfer only where its sessions can.
"""

from types import SimpleNamespace

import pytest

from moriio_fsm.engines import LoopbackEngine, TransferSession
from moriio_fsm.engines.status import failed_status
from moriio_fsm.vllm.engine_faults import inject_faults
from moriio_fsm.vllm.settings import ConnectorConfigError
from moriio_fsm.vllm.write_handlers import abandon


class UnstoppableSession(TransferSession):
    """A session of an engine whose bytes move where it cannot stop them (as mori.io's and NIXL's)."""

    def allocate_transfer_uid(self):
        return 1

    def batch_write(self, *args):
        return failed_status(13, "unused")

    def batch_read(self, *args):
        return failed_status(13, "unused")

    def alive(self):
        return True


def worker_with(sessions: dict, engine) -> SimpleNamespace:
    """The parts of a handler context that abandoning uses."""
    info = SimpleNamespace(sessions=sessions)
    forgotten = []
    return SimpleNamespace(
        directory=SimpleNamespace(get=lambda tid: info),
        engine=engine,
        forget_completions=forgotten.append,
        clock=lambda: 1.0,
        forgotten=forgotten,
    )


def test_abandoning_writes_an_engine_cannot_stop_raises_and_forgets_nothing():
    engine = SimpleNamespace()
    worker = worker_with({0: UnstoppableSession(), 1: UnstoppableSession()}, engine)
    with pytest.raises(
        RuntimeError, match="cannot stop an in-flight transfer; its blocks stay quarantined"
    ):
        abandon(worker, "tx-1", [0, 1], lambda tid, now: ("abandoned", tid, now))
    assert worker.forgotten == []


def test_abandoning_writes_kills_each_session_of_an_engine_that_can_stop_them():
    with LoopbackEngine("hooks-p") as producer, LoopbackEngine("hooks-d") as consumer:
        producer.register_remote_engine(consumer.get_engine_desc())
        source, target = producer.allocate_shared_tensor(64), consumer.allocate_shared_tensor(64)
        remote = producer.unpack_memory_desc(consumer.register_torch_tensor(target).pack())
        session = producer.create_session(producer.register_torch_tensor(source), remote)
        worker = worker_with({0: session}, producer)
        answer = abandon(worker, "tx-2", [0], lambda tid, now: ("abandoned", tid, now))
        assert answer == ("abandoned", "tx-2", 1.0) and worker.forgotten == ["tx-2"]
        status = session.write(0, 0, 8, 1)
        assert status.wait_for(10_000) and status.failed() and "killed" in status.message()
        del worker, session, source, target


def test_fault_injection_on_an_engine_without_fault_rules_is_refused_naming_the_engine():
    class NoFaults:
        faults = None

    with pytest.raises(
        ConnectorConfigError, match="NoFaults injects no faults; use the same_host backend"
    ):
        inject_faults(NoFaults(), {"fail_nth": 2})
    inject_faults(
        NoFaults(), {"message_loss_rate": 0.5}
    )  # control-message faults need no engine rules


def test_fault_injection_arms_the_engines_rules():
    with LoopbackEngine("hooks-faults") as engine:
        inject_faults(engine, {"fail_nth": 1})
        target = engine.allocate_shared_tensor(64)
        mem = engine.register_torch_tensor(target)
        status = engine.create_session(mem, mem).write(0, 8, 8, 1)
        assert status.wait_for(10_000) and status.failed() and "injected" in status.message()
        del target
