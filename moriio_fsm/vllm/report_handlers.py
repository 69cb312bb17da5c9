"""The handlers that turn a machine's verdicts into what vLLM is told, shared by both modes.

D reports a load once (``finished_recving``, with the blocks of a failed load as load
errors); P reports its blocks free once (``finished_sending``); quarantined blocks are
never reported, so vLLM never reuses memory a transfer may still touch.
"""

from __future__ import annotations

from ..logs import get_logger
from .context import HandlerContext

log = get_logger("moriio_fsm.vllm")


def _quarantine(side: str, what: str):
    def quarantine_blocks(effect) -> None:
        log.error(
            "vllm.blocks_quarantined",
            transfer_id=effect.transfer_id,
            side=side,
            reason=effect.reason,
            why=f"{what} may still touch them",
        )

    return quarantine_blocks


def decode_report_handlers(ctx: HandlerContext, op: str) -> dict:
    """D's handlers for the effects both consumer machines emit (``op``: write or read)."""

    def report(effect, failed: bool) -> None:
        info = ctx.directory.get(effect.transfer_id)
        if info is not None:
            ctx.reports.received(info.request_id, info.block_ids if failed else ())
            if failed and ctx.failure_log.allow(ctx.clock()):
                log.warning(
                    "vllm.load_failed",
                    transfer_id=effect.transfer_id,
                    request_id=info.request_id,
                    reason=effect.reason,
                    blocks=len(info.block_ids),
                    then="vLLM's kv_load_failure_policy decides",
                )

    def free_blocks(effect) -> None:
        # vLLM waits for a report only while the load was pending; otherwise it freed them.
        info = ctx.directory.get(effect.transfer_id)
        if info is not None and ctx.reports.awaits(info.request_id):
            ctx.reports.received(info.request_id)

    return {
        "hold_blocks": lambda effect: None,  # vLLM keeps a pending load's blocks itself
        "report_received": lambda effect: report(effect, False),
        "report_load_failure": lambda effect: report(effect, True),
        "free_blocks": free_blocks,
        "quarantine_blocks": _quarantine("D", f"a {op}"),
    }


def prefill_report_handlers(ctx: HandlerContext, with_quarantine: bool) -> dict:
    """P's handlers for giving its blocks back (and keeping them, when quarantined)."""

    def free_blocks(effect) -> None:
        info = ctx.directory.get(effect.transfer_id)
        if info is not None:
            ctx.reports.sent(info.request_id)

    handlers = {"free_blocks": free_blocks}
    if with_quarantine:
        handlers["quarantine_blocks"] = _quarantine("P", "a write from them")
    return handlers
