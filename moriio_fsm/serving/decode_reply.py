"""D's answer to one completion: its event stream read whole or passed on, every event checked.

Rules: an error event, a bad finish reason or a stream cut before ``[DONE]`` becomes a
``TransferFailed`` naming the transfer (or a last error event, when streaming); a P that fails
before D's first line is retried; every answer is counted once, completed, failed or cancelled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ..logs import get_logger
from .failures import WHERE_TO_LOOK, TransferFailed, raise_prefill_error
from .instances import Instance

__all__ = ["DecodeReply", "event_error", "finished_badly", "sse_event"]

log = get_logger("moriio_fsm.serving.proxy")


class Router(Protocol):
    """What a reply uses of the proxy that opened it."""

    @property
    def httpx(self) -> Any: ...

    def count(self, outcome: str) -> None: ...

    def call_error(self, exc: Exception, who: str, transfer_id: str, sent: bool) -> Exception: ...


def sse_event(line: str) -> Any:
    """The JSON of one ``data: {...}`` line, or None."""
    if not line.startswith("data: {"):
        return None
    try:
        return json.loads(line[6:])
    except ValueError:
        return None


def event_error(event: Any) -> dict | None:
    """An event's error object, if it reports one."""
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        return event["error"]
    return None


def misshapen(event: dict) -> str | None:
    """What is wrong with the shape of one of D's events, or None: ``choices`` a list of
    objects, each one's ``text`` a string and ``token_ids`` a list of integers where given."""
    choices = event.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        return f"'choices' is {type(choices).__name__}, expected a list"
    for choice in choices:
        if not isinstance(choice, dict):
            return f"a choice is {type(choice).__name__}, expected an object"
        text, token_ids = choice.get("text"), choice.get("token_ids")
        if text is not None and not isinstance(text, str):
            return f"a choice's 'text' is {type(text).__name__}, expected a string"
        if token_ids is not None and not (
            isinstance(token_ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids)
        ):
            return "a choice's 'token_ids' is not a list of integers"
    return None


def finished_badly(data: Any) -> str | None:
    """The finish reason of a choice that ended in error or abort, else None."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason") in ("error", "abort"):
                return choice["finish_reason"]
    return None


class DecodeReply:
    """D's open reply (always streamed from D): read whole (``json``) or passed on (``events``)."""

    def __init__(
        self,
        proxy: Router,
        reply,
        decode: Instance,
        transfer_id: str,
        stream: bool,
        p_task: asyncio.Future | None,
    ):
        self.proxy, self.reply, self.decode = proxy, reply, decode
        self.transfer_id, self.stream, self.p_task = transfer_id, stream, p_task
        self._lines = reply.aiter_lines()
        self._first: list[str] = []
        #: Reshapes each of D's checked events before anyone sees it (None: as D sent it).
        self.adjust: Callable[[dict], dict] | None = None

    def _failed(self, message: str, kind: str = "kv_transfer_failed") -> TransferFailed:
        return TransferFailed(
            502,
            f"transfer {self.transfer_id}: decode {self.decode.name} {message}",
            kind,
            self.transfer_id,
        )

    async def prime(self) -> None:
        """Hold D's stream until its first line or P's failure, whichever comes first: a P
        that fails before D said anything is retried (D's headers come at once)."""
        first = asyncio.ensure_future(self._lines.__anext__())
        try:
            if self.p_task is not None:
                await asyncio.wait({first, self.p_task}, return_when=asyncio.FIRST_COMPLETED)
                if self.p_task.done() and not first.done():
                    raise_prefill_error(self.p_task, self.transfer_id)
            try:
                self._first.append(await first)
            except StopAsyncIteration:
                pass
            except self.proxy.httpx.HTTPError as exc:
                raise self._failed(f"broke off its stream: {type(exc).__name__}: {exc}") from None
        except BaseException:
            if not first.done():
                first.cancel()
            await self.reply.aclose()
            raise

    async def _all_lines(self) -> AsyncIterator[str]:
        for line in self._first:
            yield line
        async for line in self._lines:
            yield line

    async def json(self) -> dict[str, Any]:
        """A non-streamed answer assembled from D's stream: the choice's text and token ids
        joined, its finish reason, and the usage D reported last."""
        texts: list[str] = []
        tokens: list[int] = []
        head: dict[str, Any] = {}
        choice: dict[str, Any] = {}
        try:
            async for event in self._events():
                if event is None:
                    break
                if event.get("usage"):
                    head["usage"] = event["usage"]
                for part in event.get("choices") or ():
                    if not choice:
                        head.update(
                            {k: v for k, v in event.items() if k not in ("choices", "usage")}
                        )
                        choice = dict(part)
                    texts.append(part.get("text") or "")
                    tokens.extend(part.get("token_ids") or ())
                    choice["finish_reason"] = part.get("finish_reason") or choice.get(
                        "finish_reason"
                    )
                    if part.get("stop_reason") is not None:
                        choice["stop_reason"] = part["stop_reason"]
        except TransferFailed:
            self.proxy.count("failed")
            raise
        choice["text"] = "".join(texts)
        if tokens or "token_ids" in choice:
            choice["token_ids"] = tokens
        self.decode.served += 1
        self.proxy.count("completed")
        return {**head, "object": "text_completion", "choices": [choice] if choice else []}

    async def _events(self) -> AsyncIterator[dict[str, Any] | None]:
        """D's events, checked, then None for its ``[DONE]``: an error event, a bad finish or
        a stream cut short before ``[DONE]`` raises ``TransferFailed`` naming the transfer."""
        try:
            async for line in self._all_lines():
                if line.strip() == "data: [DONE]":
                    yield None
                    return
                event = sse_event(line)
                if event is None:
                    continue
                error = event_error(event)
                if error is not None:
                    raise self._failed(f"failed: {error.get('message', '')}{WHERE_TO_LOOK}")
                shape = misshapen(event)
                if shape is not None:
                    raise self._failed(f"sent an event of the wrong shape: {shape}")
                bad = finished_badly(event)
                if bad is not None:
                    raise self._failed(
                        f"ended the request with finish_reason {bad!r}{WHERE_TO_LOOK}"
                    )
                yield event if self.adjust is None else self.adjust(event)
        except self.proxy.httpx.HTTPError as exc:
            failure = self.proxy.call_error(
                exc, f"decode {self.decode.name}", self.transfer_id, True
            )
            if isinstance(failure, TransferFailed):
                raise failure from None
            raise self._failed(f"broke off its stream: {failure}") from None
        finally:
            await self.reply.aclose()
        raise self._failed("ended its stream without [DONE]")

    async def events(self) -> AsyncIterator[bytes]:
        """D's server-sent events for the client; a failure becomes a last error event."""
        outcome = "failed"
        try:
            async for event in self._events():
                if event is None:
                    outcome = "completed"
                    yield b"data: [DONE]\n\n"
                    return
                yield ("data: " + json.dumps(event) + "\n\n").encode()
        except TransferFailed as exc:
            log.warning("proxy.transfer_failed", transfer=self.transfer_id, why=exc.message)
            yield ("data: " + json.dumps(exc.body()) + "\n\n").encode()
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"  # the client went away; D's request is closed
            raise
        finally:
            self.proxy.count(outcome)
            if outcome == "completed":
                self.decode.served += 1
