"""The stand-in's RDMA backend posting one batch: mori's checks, then the ranges go to the transfer thread with
what the fault rules say.

Rules (mori's ``RdmaBackendSession::BatchReadWrite``): the status turns IN_PROGRESS first; lengths that differ, a
size above UINT32_MAX or a range past either region fail it with ERR_INVALID_ARGS before anything is posted; an
empty batch succeeds at once; a dead queue pair flushes the batch (ERR_RDMA_OP, nothing moves); everything else
completes later on the transfer thread; with notifications on, the target records the transfer once it landed.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

from .faults import Fault
from .mover import InProcessMover, Mover, Region, RemoteRegion
from .registry import find_regions, notify_inbound
from .remote import SocketMover
from .transfers import Transfer, submit

__all__ = ["Route", "post_batch"]

_IN_PROGRESS, _SUCCESS = 2, 0
_ERR_INVALID_ARGS, _ERR_RDMA_OP = 11, 13
_UINT32_MAX = (1 << 32) - 1
# A dead peer's queue pair is in error state: every work request completes flushed, none lands.
_FLUSHED = Fault(
    "completion",
    _ERR_RDMA_OP,
    "work request flushed: the queue pair to the peer is in error state (stand-in)",
)


@dataclass(frozen=True)
class Route:
    """What a session fixed when it was made: its engine, its local region and the remote one."""

    engine: Any  # the stand-in IOEngine
    local: Region
    remote: RemoteRegion


def _batch_problem(route: Route, local_offsets, remote_offsets, sizes) -> str | None:
    if not len(local_offsets) == len(remote_offsets) == len(sizes):
        return "lengths of local offsets, remote offsets or sizes mismatch"
    for local_offset, remote_offset, size in zip(local_offsets, remote_offsets, sizes):
        if size > _UINT32_MAX:
            return f"single request size {size} exceeds UINT32_MAX; split it before submitting"
        if (
            local_offset + size > route.local.size
            or remote_offset + size > route.remote.region.size
        ):
            return "length out of range"
    return None


def post_batch(
    route: Route,
    op: str,
    local_offsets: list[int],
    remote_offsets: list[int],
    sizes: list[int],
    status: Any,
    uid: int,
) -> None:
    """Post one batch of ``op`` ("read" or "write") on ``route``; ``status`` ends on the transfer thread."""
    engine = route.engine
    status.set_code(_IN_PROGRESS)
    problem = _batch_problem(route, local_offsets, remote_offsets, sizes)
    if problem is not None:
        status.update(_ERR_INVALID_ARGS, problem)
        return
    if not sizes:
        status.update(_SUCCESS, "")
        return
    ranges = list(zip(local_offsets, remote_offsets, sizes))
    if engine.standin_peer_alive(route.remote.engine_key):
        fault = engine.standin_fault(op)
    else:
        fault = _FLUSHED
    _post_with(route, op, status, uid, ranges, fault)


def _post_with(
    route: Route, op: str, status: Any, uid: int, ranges: list, fault: Fault | None
) -> None:
    if fault is None or fault.stage == "hold":
        notify = fault is None and route.engine.standin_notifications()
        submit(_transfer(route, op, status, uid, ranges, gate=fault and fault.gate, notify=notify))
    elif fault.stage == "post":
        # mori's "SQ full": the first ranges were posted and still complete later, into a failed status.
        if fault.landed:
            submit(_transfer(route, op, status, uid, ranges[: fault.landed], gate=fault.gate))
        status.update(fault.code, fault.message)
    elif fault.stage == "completion":
        submit(
            _transfer(
                route,
                op,
                status,
                uid,
                ranges[: fault.landed],
                failure=(fault.code, fault.message),
                gate=fault.gate,
            )
        )
    else:
        # A failed notification send: every range still lands.
        submit(_transfer(route, op, status, uid, ranges, gate=fault.gate))
        status.update(fault.code, fault.message)


def mover_for(remote: RemoteRegion) -> Mover:
    """The mover for a transfer with ``remote``: a memmove when it is a live engine of this process, else its
    listener (another process, or a process in another PID namespace that happens to have this pid)."""
    if remote.pid == os.getpid() and find_regions(remote) is not None:
        return InProcessMover(find_regions, notify_inbound)
    return SocketMover()


def _transfer(
    route: Route,
    op: str,
    status: Any,
    uid: int,
    ranges: list,
    *,
    failure=None,
    gate=None,
    notify: bool = False,
) -> Transfer:
    engine = route.engine
    return Transfer(
        status=weakref.ref(status),
        engine=weakref.ref(engine),
        uid=uid,
        op=op,
        local=route.local,
        local_table=engine.standin_regions,
        remote=route.remote,
        ranges=ranges,
        mover=mover_for(route.remote),
        failure=failure,
        gate=gate,
        notify=notify,
    )
