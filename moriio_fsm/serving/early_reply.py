"""The client's answer when P's first token went ahead (READ mode): that token first, then D's answer opened only
now, with D's events shaped as the client's request would have them (``first_token.py``).

Rules: a streamed answer sends P's token before D is even asked, so whatever fails after it (no D reachable, D's
error) is a last error event naming the transfer; a D that never saw the request is marked down and the next one
asked, with the same KV to load; the answer is counted once: completed, failed or cancelled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..logs import get_logger
from . import first_token
from .decode_reply import DecodeReply
from .failures import NeverSaw, TransferFailed

__all__ = ["EarlyReply"]

log = get_logger("moriio_fsm.serving.proxy")

#: Opens D's part on the next decode instance (``tried`` names those that never saw it).
OpenDecode = Callable[[set[str]], Awaitable[DecodeReply]]


class EarlyReply:
    """P's first token now, D's answer after it; ``json`` or ``events`` as ``DecodeReply``."""

    def __init__(
        self,
        proxy: Any,
        transfer_id: str,
        stream: bool,
        first: first_token.FirstToken,
        first_event: dict,
        body: dict,
        open_decode: OpenDecode,
    ):
        self.proxy, self.transfer_id, self.stream = proxy, transfer_id, stream
        self._first, self._first_event, self._body = first, first_event, body
        self._open_decode = open_decode

    async def _decode(self) -> DecodeReply:
        tried: set[str] = set()
        while True:
            try:
                reply = await self._open_decode(tried)
            except NeverSaw as exc:
                self.proxy.count("retried")
                log.warning("proxy.retry", transfer=self.transfer_id, why=exc.why)
                continue
            reply.adjust = first_token.shift_event
            return reply

    async def json(self) -> dict[str, Any]:
        try:
            decode = await self._decode()
        except TransferFailed:
            self.proxy.count("failed")
            raise
        return first_token.merge_answer(await decode.json(), self._first, self._body)

    async def events(self) -> AsyncIterator[bytes]:
        yield ("data: " + json.dumps(self._first_event) + "\n\n").encode()
        try:
            decode = await self._decode()
        except TransferFailed as exc:
            self.proxy.count("failed")
            log.warning("proxy.transfer_failed", transfer=self.transfer_id, why=exc.message)
            yield ("data: " + json.dumps(exc.body()) + "\n\n").encode()
            return
        except (asyncio.CancelledError, GeneratorExit):
            self.proxy.count("cancelled")  # the client left before D was asked
            raise
        async for chunk in decode.events():
            yield chunk
