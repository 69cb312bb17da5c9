"""What the project's own engines (loopback, same host, NIXL) share beyond the interface: descriptors of their
own types, transfer uids, the closed flag, and sessions whose posts are checked before they reach the engine.

Rules: a session hands its engine only a ``CheckedBatch`` (bad values come back as already-failed statuses);
an engine's descriptors are of its own two classes, unpacked only from their own bytes.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, ClassVar

from .checks import ArgumentProblem, CheckedBatch, check_transfer_batch
from .interface import EngineDescT, MemoryDescT, TransferEngine, TransferSession
from .status import LocalTransferStatus, failed_status

__all__ = ["EngineBase", "SessionBase"]


class SessionBase(TransferSession):
    """A session between ``local_mem`` and ``remote_mem`` whose checked posts go to ``_submit``."""

    def __init__(self, engine: Any, local_mem: Any, remote_mem: Any) -> None:
        self._engine = engine
        self.local_mem = local_mem
        self.remote_mem = remote_mem
        self.remote_engine_key = remote_mem.engine_key  # what fault rules match on

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("write", local_offsets, remote_offsets, sizes, transfer_uid)

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid):
        return self._post("read", local_offsets, remote_offsets, sizes, transfer_uid)

    def note_killed(self) -> None:
        """Called by the fault rules when this session is killed; an engine whose copies can stop
        part-way tells them here."""

    def _post(self, op, local_offsets, remote_offsets, sizes, transfer_uid):
        checked = check_transfer_batch(
            local_offsets,
            remote_offsets,
            sizes,
            transfer_uid,
            local_size=self.local_mem.size,
            remote_size=self.remote_mem.size,
        )
        if isinstance(checked, ArgumentProblem):
            return failed_status(checked.code, f"batch_{op}: {checked.message}")
        return self._submit(op, checked)

    def _submit(self, op: str, batch: CheckedBatch) -> LocalTransferStatus:
        return self._engine._submit(self, op, batch)


class EngineBase(TransferEngine[EngineDescT, MemoryDescT]):
    """An engine with descriptors of its own two classes (``engine_desc_type``, ``memory_desc_type``, each
    with ``unpack``), its own uids and a ``closed`` flag that ``_set_closed`` raises once."""

    engine_desc_type: ClassVar[type[Any]]
    memory_desc_type: ClassVar[type[Any]]

    def __init__(self, key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"engine key must be a non-empty string, got {key!r}")
        self.key = key
        self._desc: Any = None
        self._uids = itertools.count(1)
        self._uid_lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def get_engine_desc(self):
        return self._desc

    def unpack_engine_desc(self, packed: bytes):
        return self.engine_desc_type.unpack(packed)

    def unpack_memory_desc(self, packed: bytes):
        return self.memory_desc_type.unpack(packed)

    def allocate_transfer_uid(self) -> int:
        with self._uid_lock:
            return next(self._uids)

    def _check_engine_desc(self, desc: Any) -> None:
        if not isinstance(desc, self.engine_desc_type):
            raise TypeError(
                f"desc must be a {self.engine_desc_type.__name__}, got {type(desc).__name__}"
            )

    def _known_remote(self, desc: Any, peers: dict[str, Any], lock: Any) -> tuple[bool, Any]:
        """Check ``desc`` for ``register_remote_engine`` against ``peers`` (key -> peer with ``desc`` and
        ``gone()``, guarded by ``lock``): (nothing to do, the peer known under its key). Nothing is to do
        for this engine's own descriptor or a live peer known with it already; a descriptor under this
        engine's key that is not its own raises ``ValueError``."""
        self._check_engine_desc(desc)
        self._require_open("register_remote_engine")
        if desc.key == self.key:
            if not self._is_own(desc):
                raise ValueError(
                    f"engine key {desc.key!r} is this engine's own, but the descriptor is another's"
                )
            return True, None
        with lock:
            known = peers.get(desc.key)
        return known is not None and known.desc == desc and known.gone() is None, known

    def _is_own(self, desc: Any) -> bool:
        return desc == self._desc

    def _check_memory_desc(self, mem: Any) -> None:
        """``mem`` must be one of this engine's own registrations (to deregister it)."""
        if not isinstance(mem, self.memory_desc_type):
            raise TypeError(
                f"mem must be a {self.memory_desc_type.__name__}, got {type(mem).__name__}"
            )
        if mem.engine_key != self.key:
            raise ValueError(
                f"memory {mem.mem_id} belongs to engine {mem.engine_key!r}, not {self.key!r}"
            )

    def _check_session_descs(self, local_mem: Any, remote_mem: Any) -> None:
        kind = self.memory_desc_type
        if not isinstance(local_mem, kind) or not isinstance(remote_mem, kind):
            raise TypeError(
                f"create_session needs two {kind.__name__}, got "
                f"{type(local_mem).__name__} and {type(remote_mem).__name__}"
            )

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: engine {self.key!r} is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.key!r} {self._where()} {state}>"

    def _where(self) -> str:
        return f"pid={self._desc.pid}"
