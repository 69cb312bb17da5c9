"""A snapshot of mori's API as MoriEngine uses it: what the adapter calls in the wheel's Python layer, the
parameters of each (read with ``inspect`` from amd-mori 1.2.4's own ``mori/io/engine.py``), the native calls
those make, and the stand-in's C++ signature for each.

Rules: a change of the pinned wheel (a renamed method, a parameter more or less, a new native call) or of the
adapter (a mori call not in the snapshot) fails here and names what changed; the snapshot is updated only after
the adapter and the stand-in were checked against the new wheel.
"""

import ast
import inspect
import sys
from pathlib import Path

import pytest

from moriio_fsm.engines import mori, mori_status

# What MoriEngine reaches in mori.io, by the names it uses for them.
ADAPTER_USES = {
    "io": {
        "BackendType",
        "EngineDesc",
        "IOEngine",
        "IOEngineConfig",
        "MemoryDesc",
        "PollCqMode",
        "RdmaBackendConfig",
        "XgmiBackendConfig",
    },
    "engine": {
        "allocate_transfer_uid",
        "create_backend",
        "create_session",
        "deregister_memory",
        "deregister_remote_engine",
        "get_engine_desc",
        "register_remote_engine",
        "register_torch_tensor",
    },
    "engine, if there": {"pop_peer_failure"},
    "session and status": {
        "Code",
        "Message",
        "Wait",
        "WaitFor",
        "alive",
        "allocate_transfer_uid",
        "batch_read",
        "batch_write",
    },
}

# The wheel's Python layer: each method the adapter calls (and the helpers they hand their arguments to).
PYTHON_LAYER = {
    "IOEngine.__init__": "(self, key, config)",
    "IOEngine.allocate_transfer_uid": "(self)",
    "IOEngine.create_backend": "(self, type, config=None)",
    "IOEngine.create_session": "(self, local_mem, remote_mem)",
    "IOEngine.deregister_memory": "(self, mem_desc)",
    "IOEngine.deregister_remote_engine": "(self, engine_desc)",
    "IOEngine.get_engine_desc": "(self)",
    "IOEngine.pop_peer_failure": "(self)",
    "IOEngine.register_memory": "(self, ptr, size, device_id, mem_loc)",
    "IOEngine.register_remote_engine": "(self, engine_desc)",
    "IOEngine.register_torch_tensor": "(self, tensor)",
    "IOEngineSession.alive": "(self)",
    "IOEngineSession.allocate_transfer_uid": "(self)",
    "IOEngineSession.batch_read": "(self, *args)",
    "IOEngineSession.batch_write": "(self, *args)",
    "IOEngineSession._batch_single_side_transfer": "(self, func, local_offsets, remote_offsets, sizes, "
    "transfer_uid)",
}

# Every native name the wheel's engine.py reads (calls, and the classes in its annotations), in any method.
NATIVE_NAMES_READ = {
    "Alive",
    "AllocateTransferUniqueId",
    "BackendType",
    "BatchRead",
    "BatchWrite",
    "CreateBackend",
    "CreateSession",
    "DeregisterMemory",
    "DeregisterRemoteEngine",
    "EngineDesc",
    "FabricBackendConfig",
    "GetEngineDesc",
    "IOEngine",
    "IOEngineConfig",
    "LoadFabricCopyModule",
    "LoadScatterGatherModule",
    "MemoryDesc",
    "MemoryLocationType",
    "PopInboundTransferStatus",
    "PopPeerFailure",
    "RdmaBackendConfig",
    "Read",
    "RegisterMemory",
    "RegisterRemoteEngine",
    "RemoveBackend",
    "TransferStatus",
    "WaitAll",
    "Write",
    "XgmiBackendConfig",
}

# The stand-in's C++ signatures of the native calls MoriEngine's path makes (mori's pybind_io.cpp).
NATIVE_SIGNATURES = {
    "IOEngineConfig.__init__": "(self: mori.cpp.IOEngineConfig, host: str = '', port: int = 0) -> None",
    "RdmaBackendConfig.__init__": (
        "(self: mori.cpp.RdmaBackendConfig, qp_per_transfer: int = 1, post_batch_size: int = -1, "
        "num_worker_threads: int = -1, poll_cq_mode: mori.cpp.PollCqMode = <PollCqMode.POLLING: 0>, "
        "enable_notification: bool = True, notif_per_qp: int = 1024, enable_transfer_chunking: bool = False, "
        "chunk_bytes: int = 65536, max_chunks_per_transfer: int = 64, num_nics_per_transfer: int = 1) -> None"
    ),
    "XgmiBackendConfig.__init__": (
        "(self: mori.cpp.XgmiBackendConfig, num_streams: int = 64, num_events: int = 64) -> None"
    ),
    "IOEngine.__init__": "(self: mori.cpp.IOEngine, arg0: str, arg1: mori.cpp.IOEngineConfig) -> None",
    "IOEngine.CreateBackend": (
        "(self: mori.cpp.IOEngine, arg0: mori.cpp.BackendType, arg1: mori.cpp.BackendConfig) -> None"
    ),
    "IOEngine.GetEngineDesc": "(self: mori.cpp.IOEngine) -> mori.cpp.EngineDesc",
    "IOEngine.RegisterRemoteEngine": "(self: mori.cpp.IOEngine, arg0: mori.cpp.EngineDesc) -> None",
    "IOEngine.DeregisterRemoteEngine": "(self: mori.cpp.IOEngine, arg0: mori.cpp.EngineDesc) -> None",
    "IOEngine.RegisterMemory": (
        "(self: mori.cpp.IOEngine, arg0: capsule, arg1: int, arg2: int, arg3: mori.cpp.MemoryLocationType) "
        "-> mori.cpp.MemoryDesc"
    ),
    "IOEngine.DeregisterMemory": "(self: mori.cpp.IOEngine, arg0: mori.cpp.MemoryDesc) -> None",
    "IOEngine.AllocateTransferUniqueId": "(self: mori.cpp.IOEngine) -> int",
    "IOEngine.CreateSession": (
        "(self: mori.cpp.IOEngine, arg0: mori.cpp.MemoryDesc, arg1: mori.cpp.MemoryDesc) "
        "-> Optional[mori.cpp.IOEngineSession]"
    ),
    "IOEngine.PopPeerFailure": "(self: mori.cpp.IOEngine) -> Optional[mori.cpp.PeerFailureEvent]",
    "IOEngine.LoadScatterGatherModule": "(self: mori.cpp.IOEngine, arg0: str) -> None",
    "IOEngineSession.AllocateTransferUniqueId": "(self: mori.cpp.IOEngineSession) -> int",
    "IOEngineSession.BatchWrite": (
        "(self: mori.cpp.IOEngineSession, arg0: list[int], arg1: list[int], arg2: list[int], "
        "arg3: mori.cpp.TransferStatus, arg4: int) -> None"
    ),
    "IOEngineSession.BatchRead": (
        "(self: mori.cpp.IOEngineSession, arg0: list[int], arg1: list[int], arg2: list[int], "
        "arg3: mori.cpp.TransferStatus, arg4: int) -> None"
    ),
    "IOEngineSession.Alive": "(self: mori.cpp.IOEngineSession) -> bool",
    "TransferStatus.__init__": "(self: mori.cpp.TransferStatus) -> None",
    "TransferStatus.Code": "(self: mori.cpp.TransferStatus) -> mori.cpp.StatusCode",
    "TransferStatus.Message": "(self: mori.cpp.TransferStatus) -> str",
    "TransferStatus.Wait": "(self: mori.cpp.TransferStatus) -> None",
    "TransferStatus.WaitFor": "(self: mori.cpp.TransferStatus, timeout_ms: int = -1) -> mori.cpp.StatusCode",
    "EngineDesc.unpack": "(arg0: bytes) -> mori.cpp.EngineDesc",
    "MemoryDesc.unpack": "(arg0: bytes) -> mori.cpp.MemoryDesc",
}


@pytest.fixture
def wheel_engine(standin):
    return sys.modules["mori.io.engine"]


def _plain(function) -> str:
    signature = inspect.signature(function)
    parameters = [
        p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
    ]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


def _attributes_on(tree: ast.AST, *owners: str) -> set[str]:
    """The attribute names read on ``owners`` (``io``, ``self._raw``...) anywhere in ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in owners:
            found.add(node.attr)
    return found


def _tree(module) -> ast.AST:
    return ast.parse(Path(module.__file__).read_text())


def test_the_adapter_calls_only_what_the_snapshot_lists():
    adapter = _tree(mori)
    assert _attributes_on(adapter, "io", "self._io") == ADAPTER_USES["io"]
    # A MoriSession's ``_engine`` is the MoriEngine: what it reads there is ours, not mori's.
    ours = {"closed", "peer_alive", "_kept"}
    assert _attributes_on(adapter, "self._engine") - ours == ADAPTER_USES["engine"]
    looked_up = {
        node.value
        for node in ast.walk(adapter)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("pop_")
    }
    assert looked_up == ADAPTER_USES["engine, if there"]
    raw_calls = _attributes_on(adapter, "self._raw") | _attributes_on(
        _tree(mori_status), "self._raw"
    )
    assert raw_calls == ADAPTER_USES["session and status"]


def test_the_wheel_python_layer_has_the_parameters_the_adapter_relies_on(wheel_engine):
    found = {}
    for name in PYTHON_LAYER:
        owner, method = name.split(".")
        found[name] = _plain(getattr(getattr(wheel_engine, owner), method))
    assert found == PYTHON_LAYER


def test_every_mori_io_name_the_adapter_uses_is_exported_by_the_wheel(standin):
    io = sys.modules["mori.io"]
    missing = {name for name in ADAPTER_USES["io"] if not hasattr(io, name)}
    missing |= {
        name
        for name in ADAPTER_USES["engine"] | ADAPTER_USES["engine, if there"]
        if not hasattr(io.IOEngine, name)
    }
    assert missing == set()


def test_the_wheel_reads_exactly_the_native_names_the_stand_in_binds(wheel_engine, standin):
    read = _attributes_on(_tree(wheel_engine), "self._engine", "self._sess", "mori_cpp")
    assert read == NATIVE_NAMES_READ
    cpp = sys.modules["mori.cpp"]
    unbound = {
        name
        for name in read
        if not (
            hasattr(cpp, name) or hasattr(cpp.IOEngine, name) or hasattr(cpp.IOEngineSession, name)
        )
    }
    assert unbound == set()


def test_the_stand_in_binds_the_calls_with_mori_signatures(standin):
    cpp = sys.modules["mori.cpp"]
    found = {}
    for name in NATIVE_SIGNATURES:
        owner, method = name.split(".")
        binding = getattr(getattr(cpp, owner), method).__binding__
        found[name] = binding.shown(owner)
    assert found == NATIVE_SIGNATURES


def test_mori_io_imports_from_the_native_module_only_what_the_stand_in_binds(standin):
    init = Path(sys.modules["mori.io"].__file__)
    imported = {
        alias.name
        for node in ast.walk(ast.parse(init.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "mori.cpp"
        for alias in node.names
    }
    assert len(imported) == 15 and imported <= standin.NATIVE_NAMES
