"""READ mode's effect handlers: D handshakes, leases and reads P's blocks; P grants and frees.

As in WRITE mode, each handler carries out one decided effect and reports back through
the machine's own events (``handshake_done``, ``layer_read_*`` via the poller); P's
blocks go back to vLLM only through the machine's ``free_blocks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..adapters.zmq import Heartbeat, LeaseGranted, Release
from ..logs import get_logger
from ..runtime.declared import events
from .report_handlers import decode_report_handlers, prefill_report_handlers
from .write_handlers import abandon

if TYPE_CHECKING:
    from .worker_half import WorkerHalf

log = get_logger("moriio_fsm.vllm")


def producer_handlers(worker: "WorkerHalf") -> dict:
    """P's handlers for the ``read_producer`` machine."""

    def send_lease_granted(effect) -> None:
        info = worker.directory.get(effect.transfer_id)
        address = info.reply_to.get(effect.consumer_rank) if info is not None else None
        if address is None:
            raise LookupError(f"transfer {effect.transfer_id!r}: D rank {effect.consumer_rank} "
                              "sent no reply port with its heartbeat")
        worker.send(address, LeaseGranted(effect.transfer_id, effect.seq, effect.lease_s,
                                          effect.consumer_rank))

    return {
        "hold_for_reads": lambda effect: None,   # vLLM holds them: request_finished said so
        "send_lease_granted": send_lease_granted,
        **prefill_report_handlers(worker, with_quarantine=False),
    }


def consumer_handlers(worker: "WorkerHalf") -> dict:
    """D's handlers for the ``read_consumer`` machine."""
    from .worker_half import peer_ranks

    def source_rank(info) -> int:
        return peer_ranks(worker.tp_rank, worker.tp_size, info.peer.tp_size)[0]

    def info_of(effect):
        info = worker.directory.get(effect.transfer_id)
        if info is None:
            raise LookupError(f"transfer {effect.transfer_id!r} has no addressing entry")
        return info

    def request_handshake(effect) -> None:
        info = info_of(effect)
        tid = effect.transfer_id
        info.link = worker.link_for(info, source_rank(info))

        def answered(future) -> None:
            now = worker.clock()
            error = future.exception()
            worker.dispatch("receive", events.handshake_done(tid, now) if error is None
                            else events.handshake_failed(tid, now, f"{type(error).__name__}: {error}"))

        info.link.add_done_callback(answered)

    def send_heartbeat(effect) -> None:
        info = info_of(effect)
        worker.send(worker.notify_endpoint(info, source_rank(info)), Heartbeat(
            effect.transfer_id, effect.seq, worker.tp_rank, reply_port=worker.transport.notify_port))

    def post_read(effect):
        info = info_of(effect)
        link = info.link.result()
        remote_ids, local_ids = tuple(effect.block_ids), info.block_ids
        local, remote, sizes = worker.cache.plan(local_ids, remote_ids[-len(local_ids):],
                                                 link.num_blocks, effect.layer)
        session = info.session(worker.engine, worker.cache, effect.layer)
        status = session.batch_read(local, remote, sizes, session.allocate_transfer_uid())
        worker.metrics.add_bytes(sum(sizes))
        return worker.completion_of(status, effect.transfer_id, effect.layer, "read")

    def send_release(effect) -> None:
        info = info_of(effect)
        worker.send(worker.notify_endpoint(info, source_rank(info)), Release(
            effect.transfer_id, consumer_tp_size=worker.tp_size, consumer_rank=worker.tp_rank))

    return {
        "request_handshake": request_handshake,
        "send_heartbeat": send_heartbeat,
        "post_read": post_read,
        "abandon_reads": lambda effect: abandon(worker, effect.transfer_id, effect.layers,
                                                events.reads_abandoned),
        "send_release": send_release,
        **decode_report_handlers(worker, "read"),
    }
