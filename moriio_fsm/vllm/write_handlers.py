"""WRITE mode's effect handlers: P writes its layers into D's blocks, D reports to vLLM.

Each handler carries out one effect the machine decided on: post a layer's write once
the link to D is up, tell D, report blocks to vLLM. A handler that cannot do its job
raises (the driver turns that into the emit's failure event) or, when it learns later,
dispatches that event itself. No handler decides what happens next. Handlers see the
rank only through its ``HandlerContext``.
"""

from __future__ import annotations

from ..adapters.zmq import Release, RemoteBlocks, WriteDone, WriteFailed
from ..runtime.declared import events
from .context import HandlerContext
from .report_handlers import decode_report_handlers, prefill_report_handlers


def abandon(ctx: HandlerContext, transfer_id: str, layers, answer):
    """Tear down the in-flight layers of a transfer; answer once no byte can still move.

    An engine that can stop a session (the same-host and loopback engines) kills this
    transfer's sessions and answers at once; one that cannot raises, and the machine
    quarantines the blocks.
    """
    info = ctx.directory.get(transfer_id)
    sessions = [
        info.sessions[layer] for layer in layers if info is not None and layer in info.sessions
    ]
    if not all(session.killable for session in sessions):
        raise RuntimeError(
            f"the {type(ctx.engine).__name__} cannot stop an in-flight "
            "transfer; its blocks stay quarantined"
        )
    for session in sessions:
        session.kill()
    ctx.forget_completions(transfer_id)
    return answer(transfer_id, ctx.clock())


def producer_handlers(ctx: HandlerContext) -> dict:
    """P's handlers for the ``write_producer`` machine."""

    def post_now(tid: str, layer: int, remote_ids, link):
        """Post one layer's write; its completion event when the engine copied it at once,
        else None.

        Runs on the forward thread, or on the I/O thread once the handshake answered.
        """
        info = ctx.directory.get(tid)
        if info is None:
            raise LookupError(f"transfer {tid!r} ended before its layer {layer} was posted")
        remote_ids = tuple(remote_ids)
        local_ids = info.local_ids_for(remote_ids)
        cache = ctx.kv_cache()
        local, remote, sizes = cache.plan(
            local_ids, remote_ids, link.num_blocks, layer, heads=link.heads
        )
        session = info.session(ctx.engine, cache, layer)
        status = session.batch_write(local, remote, sizes, session.allocate_transfer_uid())
        ctx.metrics.add_bytes(sum(sizes))
        return ctx.completion_of(status, tid, layer, "write")

    def post_write(effect):
        info = ctx.info(effect.transfer_id)
        if info.link is None:
            raise LookupError(
                f"transfer {effect.transfer_id!r}: D's address is unknown "
                "(kv_transfer_params had no remote_host)"
            )
        tid, layer, remote_ids = effect.transfer_id, effect.layer, effect.block_ids

        def when_linked(future) -> None:
            try:
                completed = post_now(tid, layer, remote_ids, future.result())
            except Exception as exc:
                completed = events.post_failed(
                    tid, ctx.clock(), layer, f"{type(exc).__name__}: {exc}"
                )
            if completed is not None:
                ctx.dispatch("send", completed)

        if info.link.done():
            return post_now(tid, layer, remote_ids, info.link.result())  # raising -> post_failed
        info.link.add_done_callback(when_linked)
        return None

    def to_d(effect, message) -> None:
        info = ctx.info(effect.transfer_id)
        if info.peer is None:
            raise LookupError(f"transfer {effect.transfer_id!r}: D's address is unknown")
        ctx.send_to_peer(info, effect.decode_rank if effect.decode_rank >= 0 else 0, message)

    rank = ctx.topology.tp_rank
    return {
        "post_write": post_write,
        "abandon_writes": lambda effect: abandon(
            ctx, effect.transfer_id, effect.layers, events.writes_abandoned
        ),
        "send_write_done": lambda effect: to_d(
            effect, WriteDone(effect.transfer_id, effect.num_writers, producer_rank=rank)
        ),
        "send_write_failed": lambda effect: to_d(
            effect,
            WriteFailed(
                effect.transfer_id,
                reason=effect.reason[:64] or "failed",
                writes_stopped=effect.writes_stopped,
                producer_rank=rank,
            ),
        ),
        **prefill_report_handlers(ctx, with_quarantine=True),
    }


def consumer_handlers(ctx: HandlerContext) -> dict:
    """D's handlers for the ``write_consumer`` machine."""
    me = ctx.topology

    def send_remote_blocks(effect) -> None:
        info = ctx.info(effect.transfer_id)
        for rank in me.peer_ranks(ctx.peer_of(info)):
            ctx.send_to_peer(
                info,
                rank,
                RemoteBlocks(
                    effect.transfer_id,
                    effect.req_id or info.request_id,
                    tuple(effect.block_ids),
                    decode_rank=me.tp_rank,
                    prompt_digest=info.prompt_digest or None,
                    decode_dp_rank=me.dp_rank,
                ),
            )

    def send_release(effect) -> None:
        info = ctx.info(effect.transfer_id)
        for rank in me.peer_ranks(ctx.peer_of(info)):
            ctx.send_to_peer(
                info,
                rank,
                Release(effect.transfer_id, consumer_tp_size=me.tp_size, consumer_rank=me.tp_rank),
            )

    return {
        "send_remote_blocks": send_remote_blocks,
        "send_release": send_release,
        **decode_report_handlers(ctx, "write"),
    }
