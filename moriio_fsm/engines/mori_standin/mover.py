"""How the stand-in's "NIC" moves bytes: between host regions registered with stand-in engines of this process.

Rules: a range moves only while both regions are registered, checked under both engines' region locks for the
whole copy, so that a region deregistered before its memory is freed is never touched; an engine that is not a
live engine of this process is reached through its listener (``remote.SocketMover``, chosen in ``rdma.py``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "InProcessMover",
    "Mover",
    "Problem",
    "Region",
    "RegionTable",
    "RemoteRegion",
]


@dataclass(frozen=True, slots=True)
class Region:
    """A registered host region: its id in its engine, where it starts and how long it is."""

    mem_id: int
    address: int
    size: int


class RegionTable:
    """One engine's registered regions; ``lock`` keeps them registered while a copy runs."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._regions: dict[int, Region] = {}

    def add(self, region: Region) -> None:
        with self.lock:
            self._regions[region.mem_id] = region

    def remove(self, mem_id: int) -> None:
        """Waits for a copy touching any region of this engine to end first."""
        with self.lock:
            self._regions.pop(mem_id, None)

    def current(self, mem_id: int) -> Region | None:
        with self.lock:
            return self._regions.get(mem_id)


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """The other side of a transfer, as its descriptors say: the engine (key, host, port, process) and the
    region."""

    engine_key: str
    host: str
    port: int
    pid: int
    region: Region


@dataclass(frozen=True, slots=True)
class Problem:
    """Why a transfer's ranges did not move, in mori's words; ``peer_unreachable`` when the other engine is
    gone (mori then also reports a peer failure)."""

    message: str
    peer_unreachable: bool = False


class Mover(Protocol):
    """Moves ``ranges`` (local offset, remote offset, size) between ``local`` and ``remote``; None when every
    range moved, else why none did. ``notify_as`` (initiator key, uid): the target records the write landed."""

    def move(
        self,
        op: str,
        local: Region,
        local_table: RegionTable,
        remote: RemoteRegion,
        ranges: list[tuple[int, int, int]],
        notify_as: tuple[str, int] | None = None,
    ) -> Problem | None: ...


class InProcessMover:
    """Both regions are in this process: ``memmove`` between them, range by range. ``find`` gives the region
    table of the live engine a ``RemoteRegion`` names, or None when there is none; ``notify`` tells that engine
    a write landed."""

    def __init__(
        self,
        find: Callable[[RemoteRegion], RegionTable | None],
        notify: Callable[[RemoteRegion, str, int], None],
    ) -> None:
        self._find = find
        self._notify = notify

    def move(self, op, local, local_table, remote, ranges, notify_as=None):
        remote_table = self._find(remote)
        if remote_table is None:
            return Problem(
                f"transport retry counter exceeded: engine {remote.engine_key!r} does not answer "
                "(stand-in)",
                peer_unreachable=True,
            )
        with local_table.lock, remote_table.lock:
            if remote_table.current(remote.region.mem_id) != remote.region:
                return Problem(
                    "remote access error: the remote memory region is not registered (stand-in)"
                )
            if local_table.current(local.mem_id) != local:
                return Problem(
                    "local protection error: the local memory region is not registered (stand-in)"
                )
            there_base = remote.region.address
            for local_offset, remote_offset, size in ranges:
                here, there = local.address + local_offset, there_base + remote_offset
                if op == "write":
                    ctypes.memmove(there, here, size)
                else:
                    ctypes.memmove(here, there, size)
        if notify_as is not None:
            self._notify(remote, *notify_as)
        return None
