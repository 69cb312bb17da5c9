"""WRITE mode's effect handlers: P writes its layers into D's blocks, D reports to vLLM.

Each handler carries out one effect the machine decided on: post a layer's write once
the link to D is up, tell D, report blocks to vLLM. A handler that cannot do its job
raises (the driver turns that into the emit's failure event) or, when it learns later,
dispatches that event itself. No handler decides what happens next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..adapters.zmq import Release, RemoteBlocks, WriteDone, WriteFailed
from ..logs import get_logger
from ..runtime.declared import events
from .report_handlers import decode_report_handlers, prefill_report_handlers

if TYPE_CHECKING:
    from .worker_half import WorkerHalf

log = get_logger("moriio_fsm.vllm")


def _info(worker: "WorkerHalf", effect):
    info = worker.directory.get(effect.transfer_id)
    if info is None:
        raise LookupError(f"transfer {effect.transfer_id!r} has no addressing entry on this rank")
    return info


def abandon(worker: "WorkerHalf", transfer_id: str, layers, answer):
    """Tear down the in-flight layers of a transfer; answer once no byte can still move.

    An engine that can stop a session (the same-host and loopback engines) kills this
    transfer's sessions and answers at once; one that cannot raises, and the machine
    quarantines the blocks.
    """
    info = worker.directory.get(transfer_id)
    sessions = [info.sessions[layer] for layer in layers
                if info is not None and layer in info.sessions]
    if not all(session.killable for session in sessions):
        raise RuntimeError(f"the {type(worker.engine).__name__} cannot stop an in-flight "
                           "transfer; its blocks stay quarantined")
    for session in sessions:
        session.kill()
    worker.poller.forget(transfer_id)
    return answer(transfer_id, worker.clock())


def producer_handlers(worker: "WorkerHalf") -> dict:
    """P's handlers for the ``write_producer`` machine."""

    def post_now(tid: str, layer: int, remote_ids, link):
        """Post one layer's write; its completion event when the engine copied it at once, else None.

        Runs on the forward thread, or on the I/O thread once the handshake answered.
        """
        info = worker.directory.get(tid)
        if info is None:
            raise LookupError(f"transfer {tid!r} ended before its layer {layer} was posted")
        remote_ids = tuple(remote_ids)
        local_ids = info.local_ids_for(remote_ids)
        local, remote, sizes = worker.cache.plan(local_ids, remote_ids, link.num_blocks, layer)
        session = info.session(worker.engine, worker.cache, layer)
        status = session.batch_write(local, remote, sizes, session.allocate_transfer_uid())
        worker.metrics.add_bytes(sum(sizes))
        return worker.completion_of(status, tid, layer, "write")

    def post_write(effect):
        info = _info(worker, effect)
        if info.link is None:
            raise LookupError(f"transfer {effect.transfer_id!r}: D's address is unknown "
                              "(kv_transfer_params had no remote_host)")
        tid, layer, remote_ids = effect.transfer_id, effect.layer, effect.block_ids

        def when_linked(future) -> None:
            try:
                completed = post_now(tid, layer, remote_ids, future.result())
            except Exception as exc:
                completed = events.post_failed(tid, worker.clock(), layer, f"{type(exc).__name__}: {exc}")
            if completed is not None:
                worker.dispatch("send", completed)

        if info.link.done():
            return post_now(tid, layer, remote_ids, info.link.result())   # raising -> post_failed
        info.link.add_done_callback(when_linked)
        return None

    def to_d(effect, message) -> None:
        info = _info(worker, effect)
        if info.peer is None:
            raise LookupError(f"transfer {effect.transfer_id!r}: D's address is unknown")
        rank = effect.decode_rank if effect.decode_rank >= 0 else 0
        worker.send(worker.notify_endpoint(info, rank), message)

    return {
        "post_write": post_write,
        "abandon_writes": lambda effect: abandon(worker, effect.transfer_id, effect.layers,
                                                 events.writes_abandoned),
        "send_write_done": lambda effect: to_d(effect, WriteDone(
            effect.transfer_id, effect.num_writers, producer_rank=worker.tp_rank)),
        "send_write_failed": lambda effect: to_d(effect, WriteFailed(
            effect.transfer_id, reason=effect.reason[:64] or "failed",
            writes_stopped=effect.writes_stopped, producer_rank=worker.tp_rank)),
        **prefill_report_handlers(worker, with_quarantine=True),
    }


def consumer_handlers(worker: "WorkerHalf") -> dict:
    """D's handlers for the ``write_consumer`` machine."""
    from .worker_half import peer_ranks

    def writers(info):
        return peer_ranks(worker.tp_rank, worker.tp_size, info.peer.tp_size)

    def send_remote_blocks(effect) -> None:
        info = _info(worker, effect)
        for rank in writers(info):
            worker.send(worker.notify_endpoint(info, rank), RemoteBlocks(
                effect.transfer_id, effect.req_id or info.request_id, tuple(effect.block_ids),
                decode_rank=worker.tp_rank, prompt_digest=info.prompt_digest or None,
                decode_dp_rank=worker.dp_rank))

    def send_release(effect) -> None:
        info = _info(worker, effect)
        for rank in writers(info):
            worker.send(worker.notify_endpoint(info, rank), Release(
                effect.transfer_id, consumer_tp_size=worker.tp_size, consumer_rank=worker.tp_rank))

    return {
        "send_remote_blocks": send_remote_blocks,
        "send_release": send_release,
        **decode_report_handlers(worker, "write"),
    }
