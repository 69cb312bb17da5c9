"""READ mode's effect handlers: D handshakes, leases and reads P's blocks; P grants and frees.

As in WRITE mode, each handler carries out one decided effect and reports back through
the machine's own events (``handshake_done``, ``layer_read_*`` via the poller); P's
blocks go back to vLLM only through the machine's ``free_blocks``. Handlers see the rank
only through its ``HandlerContext``.
"""

from __future__ import annotations

from ..adapters.zmq import Heartbeat, LeaseGranted, Release
from ..runtime.declared import events
from .context import HandlerContext
from .report_handlers import decode_report_handlers, prefill_report_handlers
from .write_handlers import abandon


def producer_handlers(ctx: HandlerContext) -> dict:
    """P's handlers for the ``read_producer`` machine."""

    def send_lease_granted(effect) -> None:
        info = ctx.directory.get(effect.transfer_id)
        address = info.reply_to.get(effect.consumer_rank) if info is not None else None
        if address is None:
            raise LookupError(
                f"transfer {effect.transfer_id!r}: D rank {effect.consumer_rank} "
                "sent no reply port with its heartbeat"
            )
        ctx.send(
            address,
            LeaseGranted(effect.transfer_id, effect.seq, effect.lease_s, effect.consumer_rank),
        )

    return {
        "hold_for_reads": lambda effect: None,  # vLLM holds them: request_finished said so
        "send_lease_granted": send_lease_granted,
        **prefill_report_handlers(ctx, with_quarantine=False),
    }


def consumer_handlers(ctx: HandlerContext) -> dict:
    """D's handlers for the ``read_consumer`` machine."""
    me = ctx.topology

    def request_handshake(effect) -> None:
        info = ctx.info(effect.transfer_id)
        tid = effect.transfer_id
        info.link = ctx.link_for(info, me.first_peer_rank(ctx.peer_of(info)))

        def answered(future) -> None:
            now = ctx.clock()
            error = future.exception()
            ctx.dispatch(
                "receive",
                events.handshake_done(tid, now)
                if error is None
                else events.handshake_failed(tid, now, f"{type(error).__name__}: {error}"),
            )

        info.link.add_done_callback(answered)

    def send_heartbeat(effect) -> None:
        info = ctx.info(effect.transfer_id)
        ctx.send_to_peer(
            info,
            me.first_peer_rank(ctx.peer_of(info)),
            Heartbeat(effect.transfer_id, effect.seq, me.tp_rank, reply_port=ctx.reply_port()),
        )

    def post_read(effect):
        info = ctx.info(effect.transfer_id)
        link = info.link.result()
        remote_ids, local_ids = tuple(effect.block_ids), info.block_ids
        cache = ctx.kv_cache()
        local, remote, sizes = cache.plan(
            local_ids, remote_ids[-len(local_ids) :], link.num_blocks, effect.layer
        )
        session = info.session(ctx.engine, cache, effect.layer)
        status = session.batch_read(local, remote, sizes, session.allocate_transfer_uid())
        ctx.metrics.add_bytes(sum(sizes))
        return ctx.completion_of(status, effect.transfer_id, effect.layer, "read")

    def send_release(effect) -> None:
        info = ctx.info(effect.transfer_id)
        ctx.send_to_peer(
            info,
            me.first_peer_rank(ctx.peer_of(info)),
            Release(effect.transfer_id, consumer_tp_size=me.tp_size, consumer_rank=me.tp_rank),
        )

    return {
        "request_handshake": request_handshake,
        "send_heartbeat": send_heartbeat,
        "post_read": post_read,
        "abandon_reads": lambda effect: abandon(
            ctx, effect.transfer_id, effect.layers, events.reads_abandoned
        ),
        "send_release": send_release,
        **decode_report_handlers(ctx, "read"),
    }
