"""The engine interface declares every hook the vLLM worker calls, with defaults that do nothing and say so.

An engine that has no use for a hook (NIXL, mori.io, any third one) must still answer it: the worker calls
each hook on every engine, without probing for it.
"""

import pytest

from moriio_fsm.engines import (
    LoopbackEngine,
    LoopbackFaults,
    MoriEngine,
    TransferEngine,
    TransferSession,
)
from moriio_fsm.engines.nixl import NixlEngine
from moriio_fsm.engines.same_host import CrossMemoryEngine
from moriio_fsm.engines.status import failed_status

#: What the worker calls on an engine, and on a session (write_handlers.abandon).
WORKER_HOOKS = (
    "faults",
    "inline_copies",
    "posting_together",
    "prepare_remote_memory",
    "help_writers",
    "interrupt_help",
    "wait_for_copies",
)


class BareSession(TransferSession):
    """A session of an engine that implements only the abstract methods."""

    def allocate_transfer_uid(self):
        return 1

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return failed_status(13, "nothing moves here")

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return failed_status(13, "nothing moves here")

    def alive(self):
        return True


class BareEngine(TransferEngine):
    key = "bare"

    def get_engine_desc(self):
        return None

    def unpack_engine_desc(self, packed):
        return None

    def register_remote_engine(self, desc):
        pass

    def deregister_remote_engine(self, desc):
        pass

    def register_torch_tensor(self, tensor):
        return None

    def deregister_memory(self, mem):
        pass

    def unpack_memory_desc(self, packed):
        return None

    def allocate_transfer_uid(self):
        return 1

    def create_session(self, local_mem, remote_mem):
        return BareSession()

    def close(self):
        pass


def test_an_engine_without_hooks_of_its_own_answers_every_one_at_once_doing_nothing():
    engine = BareEngine()
    assert engine.faults is None and engine.inline_copies is False
    assert (
        engine.help_writers() == 0 and engine.help_writers(5.0, 5.0) == 0
    )  # no writer is ever helped
    assert engine.wait_for_copies() is True and engine.wait_for_copies(5.0) is True
    assert engine.interrupt_help() is None and engine.prepare_remote_memory(object()) is None
    with engine.posting_together():
        status = engine.create_session(None, None).write(0, 0, 8, 1)
    assert status.failed()  # a post inside the block went its way at once


def test_a_session_that_cannot_stop_its_transfers_says_so_and_refuses_to_pretend():
    session = BareSession()
    assert session.killable is False
    with pytest.raises(RuntimeError, match="BareSession cannot stop a transfer in flight"):
        session.kill()


@pytest.mark.parametrize(
    "engine_class", [LoopbackEngine, CrossMemoryEngine, NixlEngine, MoriEngine]
)
def test_every_engine_declares_every_hook_the_worker_calls(engine_class):
    for hook in WORKER_HOOKS:
        assert hasattr(engine_class, hook), f"{engine_class.__name__} lacks {hook}"
    assert issubclass(engine_class, TransferEngine)


def test_the_engines_that_inject_faults_take_the_rules_and_stop_their_sessions():
    with LoopbackEngine("hooks-a") as first, LoopbackEngine("hooks-b") as second:
        assert isinstance(first.faults, LoopbackFaults)
        first.register_remote_engine(second.get_engine_desc())
        target = second.allocate_shared_tensor(64)
        source = first.allocate_shared_tensor(64)
        session = first.create_session(
            first.register_torch_tensor(source),
            first.unpack_memory_desc(second.register_torch_tensor(target).pack()),
        )
        assert session.killable
        session.kill()
        status = session.write(0, 0, 8, 1)
        assert status.wait_for(10_000) and status.failed() and "killed" in status.message()
        del session, source, target


def test_the_same_host_engines_waits_come_from_its_tuning(monkeypatch):
    """The worker asks without figures; the engine's own tuning says how long a help call and a wait
    for copies may take, and changing one engine's tuning changes no other's."""
    with (
        CrossMemoryEngine("hooks-tuned", share_pages=True) as engine,
        CrossMemoryEngine("hooks-other") as other,
    ):
        if engine._board is None:
            pytest.skip("the native copy-assist module was not built")
        asked = []
        monkeypatch.setattr(
            engine._board, "help", lambda wait_s, linger_s: asked.append((wait_s, linger_s)) or 0
        )
        monkeypatch.setattr(engine.tuning, "assist_wait_s", 0.125)
        monkeypatch.setattr(engine.tuning, "assist_linger_s", 0.25)
        assert engine.help_writers() == 0 and engine.help_writers(0.5, 0.0) == 0
        assert asked == [(0.125, 0.25), (0.5, 0.0)]
        assert other.tuning.assist_wait_s != 0.125
        assert engine.wait_for_copies() is True  # nothing copies: the tuning's wait is not spent
