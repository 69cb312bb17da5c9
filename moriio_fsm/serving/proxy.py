"""The P/D proxy's routing: each completion split into P's part and D's, one transfer id each.

In WRITE mode P (``max_tokens=1``) is asked first and D once P accepted (P's stream
opened), each told where the other's connector listens; then both run at once. In READ
mode D is asked after P answered, with the ``kv_transfer_params`` P returned. D's answer,
streamed or not, goes back to the client. Rules: the client never gets a silent wrong
answer (a failed transfer, a cut stream or a timeout is an HTTP error or an error event
naming the transfer); only an instance that could not be reached is marked down; a
request whose P or D never saw it is retried on the next instance with a new transfer id.
The HTTP front is ``proxy_app.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from typing import Any, AsyncIterator, Callable

from ..logs import get_logger
from .instances import Instance, Pool, ProxyConfig, ProxyConfigError

log = get_logger("moriio_fsm.serving.proxy")

__all__ = ["DecodeReply", "Instance", "Proxy", "ProxyConfig", "ProxyConfigError", "TransferFailed"]

#: What a D failure most often means behind this proxy, and where its story is.
WHERE_TO_LOOK = (" (D could not load the prompt's KV cache, or its engine failed; "
                 "`moriio-fsm explain` on D's and P's connector traces with --transfer "
                 "shows what happened to the transfer)")
#: Request fields a P/D split cannot serve: D never computes the prompt itself.
UNSUPPORTED = {"best_of": "best_of > 1", "use_beam_search": "beam search",
               "prompt_logprobs": "prompt_logprobs", "echo": "echo"}


class TransferFailed(Exception):
    """A request failed: the HTTP status, the message and kind the client gets, its transfer."""

    def __init__(self, status: int, message: str, kind: str = "kv_transfer_failed",
                 transfer_id: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.transfer_id = status, message, kind, transfer_id

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "transfer_id": self.transfer_id}}


class _Unreachable(Exception):
    """An instance could not be reached, or died under the request: mark it down."""


class _NeverSaw(Exception):
    """The instance of ``role`` never got the request: mark it down, retry elsewhere."""

    def __init__(self, role: str, why: str):
        super().__init__(why)
        self.role, self.why = role, why


#: What a field may hold, each kind by its name in error messages.
KINDS: dict[str, Callable[[Any], bool]] = {
    "a number": lambda v: type(v) in (int, float),
    "an integer": lambda v: type(v) is int,
    "true or false": lambda v: type(v) is bool,
    "a string": lambda v: type(v) is str,
    "a string or a list of strings":
        lambda v: type(v) is str or (type(v) is list and all(type(x) is str for x in v)),
    "a list of token ids (ints >= 0)":
        lambda v: type(v) is list and all(type(x) is int and x >= 0 for x in v),
    "an object of numbers": lambda v: type(v) is dict and all(type(x) in (int, float) for x in v.values()),
    "an object": lambda v: type(v) is dict,
}
#: The sampling fields and the kind each must be (or null: OpenAI clients send null for
#: unset). Checked here because in WRITE mode P runs before D is asked, and some of them
#: reach D only (``stream_options``, ``min_tokens``).
FIELD_TYPES = {
    **dict.fromkeys(("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"), "a number"),
    **dict.fromkeys(("top_k", "seed", "logprobs", "min_tokens"), "an integer"),
    **dict.fromkeys(("ignore_eos", "skip_special_tokens", "return_token_ids",
                     "include_stop_str_in_output"), "true or false"),
    **dict.fromkeys(("model", "suffix", "user"), "a string"),
    "stop": "a string or a list of strings", "stop_token_ids": "a list of token ids (ints >= 0)",
    "logit_bias": "an object of numbers", "stream_options": "an object",
}


def _bad(message: str) -> TransferFailed:
    return TransferFailed(400, message, "invalid_request_error")


def _shown(value: Any, limit: int = 80) -> str:
    """``repr`` of a client's value, short enough for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:          # a lone surrogate ("\ud800"): JSON allows it, UTF-8 not
        return False


def _where(parent: str, key: str | int | None) -> str:
    """The path of ``key`` in the value at ``parent``: ``logit_bias."50256"``, ``stop[1]``."""
    if key is None:
        return parent
    if isinstance(key, int):
        return f"{parent}[{key}]"
    shown = key if key.isidentifier() else json.dumps(key)        # escapes what is unprintable
    return f"{parent}.{shown}" if parent else shown


_CHECKED = (float, str, dict, list)


def check_values(body: Any) -> None:
    """Refuse a value that cannot be sent on to P and D, naming where it is: a number that is
    not finite (``NaN``, ``-Infinity``, ``1e999``) or a string or key with a lone surrogate.
    Walks without recursion; a path is only made for containers and for what is refused."""
    stack: list[tuple[str, Any, Any]] = [("", None, body)]      # (parent's path, key, value)
    while stack:
        parent, key, value = stack.pop()
        kind = type(value)
        if kind is float:
            if not math.isfinite(value):
                raise _bad(f"'{_where(parent, key)}' must be a finite number, got {value!r}")
        elif kind is str:
            if not _encodes(value):
                raise _bad(f"'{_where(parent, key)}' is not valid Unicode: it holds a lone surrogate")
        elif kind is dict:
            where = _where(parent, key)
            for name, item in value.items():
                if not _encodes(name):
                    raise _bad(f"a key of '{where or 'the request'}' is not valid Unicode: "
                               f"{json.dumps(name)} holds a lone surrogate")
                if type(item) in _CHECKED:
                    stack.append((where, name, item))
        elif kind is list:
            where = _where(parent, key)
            stack.extend((where, index, item) for index, item in enumerate(value)
                         if type(item) in _CHECKED)


def check_request(body: Any) -> None:
    """Refuse what one P/D transfer cannot serve, naming the field and what was expected."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    check_values(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' is empty")
    elif isinstance(prompt, list):
        if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
            raise _bad("'prompt' must be a string or one non-empty list of token ids (ints >= 0); "
                       "send one prompt per request behind a P/D proxy")
    else:
        raise _bad(f"'prompt' must be a string or a list of token ids, got "
                   f"{type(prompt).__name__ if 'prompt' in body else 'nothing'}")
    if "kv_transfer_params" in body:
        raise _bad("'kv_transfer_params' is set by the proxy; leave it out")
    if not isinstance(body.get("stream", False), bool):
        raise _bad(f"'stream' must be true or false, got {_shown(body['stream'])}")
    n = body.get("n")
    if n is not None and not (type(n) is int and n == 1):
        raise _bad(f"'n' must be 1 behind a P/D proxy, got {_shown(n)}")
    for key, what in UNSUPPORTED.items():
        value = body.get(key)
        if value not in (None, False, 1) or (key == "prompt_logprobs" and value is not None):
            raise _bad(f"{what} ('{key}') is not served behind a P/D proxy, got {_shown(value)}")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and not (type(max_tokens) is int and max_tokens >= 1):
        raise _bad(f"'max_tokens' must be an integer >= 1, got {_shown(max_tokens)}")
    for key, kind in FIELD_TYPES.items():
        value = body.get(key)
        if value is not None and not KINDS[kind](value):
            raise _bad(f"'{key}' must be {kind}, got {_shown(value)}")


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


def finished_badly(data: Any) -> str | None:
    """The finish reason of a choice that ended in error or abort, else None."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason") in ("error", "abort"):
                return choice["finish_reason"]
    return None


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class Proxy:
    """The routing logic, independent of the HTTP framework that serves it."""

    def __init__(self, config: ProxyConfig):
        import httpx

        self.config = config
        self.prefill = Pool("prefill", config.prefills)
        self.decode = Pool("decode", config.decodes)
        # cancelled: the client left before its answer (left_mid_body: while sending its body);
        # rejected: refused unserved (body_timeouts: its body took too long).
        self.counts = {"requests": 0, "completed": 0, "failed": 0, "retried": 0, "rejected": 0,
                       "cancelled": 0, "left_mid_body": 0, "body_timeouts": 0}
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s,
                                pool=config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=config.upstream_connections, max_keepalive_connections=64))
        # Probes have their own connections: a busy pool must not make instances look down.
        self.prober = httpx.AsyncClient(timeout=2.0)
        self._httpx = httpx
        self._background: set[asyncio.Future] = set()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.client.aclose()
        await self.prober.aclose()

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1

    # -- health ------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 while one P and one D are up, else 503; the instances and the counts."""
        body = {"mode": self.config.mode, "counts": dict(self.counts),
                "prefill": [i.describe() for i in self.prefill.instances],
                "decode": [i.describe() for i in self.decode.instances]}
        ready = any(i.up for i in self.prefill.instances) and any(i.up for i in self.decode.instances)
        return (200 if ready else 503), body

    async def probe_forever(self) -> None:
        """Bring instances marked down back once their ``/health`` answers."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            down = [(pool, i) for pool in (self.prefill, self.decode) for i in pool.instances if not i.up]
            results = await asyncio.gather(*(self._healthy(i) for _, i in down), return_exceptions=True)
            for (pool, instance), healthy in zip(down, results):
                if healthy is True:
                    pool.mark_up(instance)

    async def _healthy(self, instance: Instance) -> bool:
        try:
            reply = await self.prober.get(f"{instance.url}/health")
            return reply.status_code == 200
        except Exception:           # whatever went wrong, the instance stays down
            return False

    # -- errors of a call to an instance -----------------------------------------------------

    def _call_error(self, exc: Exception, who: str, transfer_id: str, sent: bool) -> Exception:
        """What an httpx error means: the instance never saw the request (retry elsewhere),
        died under it, is too slow, or the proxy itself is out of connections."""
        httpx = self._httpx
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return _Unreachable(f"{type(exc).__name__}: {exc}") if sent else \
                _NeverSaw(who, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, httpx.PoolTimeout):
            return TransferFailed(503, f"transfer {transfer_id}: the proxy has no free connection "
                                       f"to {who} (upstream_connections "
                                       f"{self.config.upstream_connections})",
                                  "service_unavailable", transfer_id)
        if isinstance(exc, httpx.TimeoutException):
            return TransferFailed(504, f"transfer {transfer_id}: {who} sent nothing for "
                                       f"{self.config.request_timeout_s:.0f}s", "timeout", transfer_id)
        if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            return _Unreachable(f"{type(exc).__name__}: {exc}")
        return TransferFailed(502, f"transfer {transfer_id}: {who} failed: {type(exc).__name__}: "
                                   f"{exc}", "kv_transfer_failed", transfer_id)

    def _refused(self, instance: Instance, role: str, status: int, text: str,
                 transfer_id: str) -> TransferFailed:
        """An instance's non-200 answer: the client's mistake stays a 4xx, a failure a 502."""
        message = f"transfer {transfer_id}: {role} {instance.name} ({instance.url}) answered " \
                  f"{status}: {_short(text)}"
        if status < 500:
            return TransferFailed(status, message, "invalid_request_error", transfer_id)
        return TransferFailed(502, message + (WHERE_TO_LOOK if role == "decode" else ""),
                              "kv_transfer_failed", transfer_id)

    # -- one completion ----------------------------------------------------------------------

    async def complete(self, body: Any) -> "DecodeReply":
        """Route one completion; D's open reply, or ``TransferFailed`` naming the transfer."""
        self.count("requests")
        try:
            check_request(body)
        except TransferFailed:
            self.count("rejected")
            raise
        tried = {"prefill": set(), "decode": set()}
        last_error = ""
        while True:
            prefill = self.prefill.pick(exclude=tried["prefill"])
            decode = self.decode.pick(exclude=tried["decode"])
            if prefill is None or decode is None:
                pool = self.prefill if prefill is None else self.decode
                self.count("failed")
                raise TransferFailed(503, f"no {pool.role} instance is available ({pool.unavailable()})"
                                          + (f"; last attempt: {last_error}" if last_error else ""),
                                     "service_unavailable")
            transfer_id = f"tx-{uuid.uuid4().hex}"
            try:
                return await self._attempt(body, transfer_id, prefill, decode)
            except _NeverSaw as exc:
                instance, pool = (prefill, self.prefill) if exc.role.startswith("prefill") \
                    else (decode, self.decode)
                tried[pool.role].add(instance.name)
                pool.mark_down(instance, exc.why)
                self.count("retried")
                last_error = f"transfer {transfer_id}: {pool.role} {instance.name} unreachable ({exc.why})"
                log.warning("proxy.retry", transfer=transfer_id, instance=instance.name, why=exc.why)
            except TransferFailed as exc:
                self.count("failed")
                log.warning("proxy.transfer_failed", transfer=transfer_id, status=exc.status,
                            why=exc.message)
                raise

    async def _attempt(self, body: dict, transfer_id: str, prefill: Instance,
                       decode: Instance) -> "DecodeReply":
        stream = bool(body.get("stream", False))
        p_body = dict(body, max_tokens=1, stream=self.config.mode == "write")
        for key in ("stream_options", "min_tokens"):
            p_body.pop(key, None)
        params = {"do_remote_decode": True, "transfer_id": transfer_id, **self.config.extra_prefill_params}
        if self.config.mode == "write":
            params.update(decode.peer_params())
        p_body["kv_transfer_params"] = params
        d_body = dict(body)
        who = f"prefill {prefill.name}"
        if self.config.mode == "read":
            d_body["kv_transfer_params"] = await self._read_prefill(prefill, p_body, transfer_id)
            return await self._open_decode(decode, d_body, transfer_id, stream, None)
        d_body["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id,
                                        **prefill.peer_params()}
        # D is asked once P accepted its part, so that D never holds blocks against a P
        # that never got the request; then both run at once.
        p_reply = await self._open(prefill, who, p_body, transfer_id, "prefill")
        p_task = asyncio.ensure_future(self._finish_prefill(prefill, p_reply, transfer_id))
        self._background.add(p_task)
        p_task.add_done_callback(self._forget)
        try:
            return await self._open_decode(decode, d_body, transfer_id, stream, p_task)
        except BaseException:
            p_task.cancel()                 # closing P's request makes vLLM abort it
            raise

    def _forget(self, task: asyncio.Future) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()                # P failing after D answered changes nothing now

    async def _open(self, instance: Instance, who: str, body: dict, transfer_id: str, role: str):
        """Send ``body`` streamed; the open reply once its status is 200."""
        request = self.client.build_request("POST", f"{instance.url}/v1/completions", json=body,
                                            headers={"X-Request-Id": transfer_id})
        try:
            reply = await self.client.send(request, stream=True)
        except self._httpx.HTTPError as exc:
            raise self._call_error(exc, who, transfer_id, sent=False) from None
        if reply.status_code != 200:
            try:
                text = (await reply.aread()).decode(errors="replace")
            except self._httpx.HTTPError:
                text = ""
            finally:
                await reply.aclose()
            raise self._refused(instance, role, reply.status_code, text, transfer_id)
        return reply

    async def _read_prefill(self, prefill: Instance, body: dict, transfer_id: str) -> dict:
        """READ mode: P's whole answer; the ``kv_transfer_params`` D needs from it."""
        who = f"prefill {prefill.name}"
        reply = await self._open(prefill, who, body, transfer_id, "prefill")
        try:
            raw = await reply.aread()
        except self._httpx.HTTPError as exc:
            error = self._call_error(exc, who, transfer_id, sent=True)
            if isinstance(error, _Unreachable):
                self.prefill.mark_down(prefill, str(error))
                error = TransferFailed(502, f"transfer {transfer_id}: {who} died under the "
                                            f"request ({error})", "kv_transfer_failed", transfer_id)
            raise error from None
        finally:
            await reply.aclose()
        try:
            data = json.loads(raw)
        except ValueError:
            raise TransferFailed(502, f"transfer {transfer_id}: {who} answered something that is "
                                      f"not JSON: {_short(raw.decode(errors='replace'))}",
                                 "kv_transfer_failed", transfer_id) from None
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict):
            raise TransferFailed(502, f"transfer {transfer_id}: {who} returned no kv_transfer_params "
                                      "(is its connector a kv_producer in READ mode?)",
                                 "kv_transfer_failed", transfer_id)
        prefill.served += 1
        return params

    async def _finish_prefill(self, instance: Instance, reply, transfer_id: str) -> None:
        """WRITE mode: read P's stream to its end; an error event or a cut stream fails it."""
        who = f"prefill {instance.name}"
        done = False
        try:
            async for line in reply.aiter_lines():
                error = event_error(sse_event(line))
                if error is not None:
                    raise TransferFailed(502, f"transfer {transfer_id}: {who} failed: "
                                              f"{_short(str(error.get('message')))}",
                                         "kv_transfer_failed", transfer_id)
                done = done or line.strip() == "data: [DONE]"
        except self._httpx.HTTPError as exc:
            error = self._call_error(exc, who, transfer_id, sent=True)
            if isinstance(error, _Unreachable):
                self.prefill.mark_down(instance, str(error))
            raise error from None
        finally:
            await reply.aclose()
        if not done:
            raise _Unreachable(f"{who}'s stream ended without [DONE]")
        instance.served += 1

    async def _open_decode(self, decode: Instance, body: dict, transfer_id: str, stream: bool,
                           p_task: asyncio.Future | None) -> "DecodeReply":
        """Send D its part; in WRITE mode watch P's part meanwhile, so that a P that fails
        before D said anything ends D's request instead of leaving D waiting for writes."""
        if not stream:                      # D always streams: a cut answer then shows
            body = dict(body, stream=True, stream_options={"include_usage": True})
        send = asyncio.ensure_future(self._open(decode, f"decode {decode.name}", body,
                                                transfer_id, "decode"))
        try:
            if p_task is not None:
                await asyncio.wait({send, p_task}, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and not send.done():
                    _raise_prefill_error(p_task, transfer_id)
            reply = await send
        except BaseException:
            if not send.done():
                send.cancel()
            elif not send.cancelled() and send.exception() is None:
                await send.result().aclose()
            raise
        answer = DecodeReply(self, reply, decode, transfer_id, stream, p_task)
        await answer.prime()
        return answer


def _raise_prefill_error(p_task: asyncio.Future, transfer_id: str) -> None:
    error = p_task.exception()
    if isinstance(error, _Unreachable):           # P died before D said anything: retry
        raise _NeverSaw("prefill (died)", str(error))
    if error is not None:
        raise error


class DecodeReply:
    """D's open reply (always streamed from D): read whole (``json``) or passed on (``events``)."""

    def __init__(self, proxy: Proxy, reply, decode: Instance, transfer_id: str, stream: bool,
                 p_task: asyncio.Future | None):
        self.proxy, self.reply, self.decode = proxy, reply, decode
        self.transfer_id, self.stream, self.p_task = transfer_id, stream, p_task
        self._lines = reply.aiter_lines()
        self._first: list[str] = []

    def _failed(self, message: str, kind: str = "kv_transfer_failed") -> TransferFailed:
        return TransferFailed(502, f"transfer {self.transfer_id}: decode {self.decode.name} {message}",
                              kind, self.transfer_id)

    async def prime(self) -> None:
        """Hold D's stream until its first line or P's failure, whichever comes first: a P
        that fails before D said anything is retried (D's headers come at once)."""
        first = asyncio.ensure_future(self._lines.__anext__())
        try:
            if self.p_task is not None:
                await asyncio.wait({first, self.p_task}, return_when=asyncio.FIRST_COMPLETED)
                if self.p_task.done() and not first.done():
                    _raise_prefill_error(self.p_task, self.transfer_id)
            try:
                self._first.append(await first)
            except StopAsyncIteration:
                pass
            except self.proxy._httpx.HTTPError as exc:
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
            async for event, done in self._events():
                if done:
                    break
                if event.get("usage"):
                    head["usage"] = event["usage"]
                for part in event.get("choices") or ():
                    if not choice:
                        head.update({k: v for k, v in event.items() if k not in ("choices", "usage")})
                        choice = dict(part)
                    texts.append(part.get("text") or "")
                    tokens.extend(part.get("token_ids") or ())
                    choice["finish_reason"] = part.get("finish_reason") or choice.get("finish_reason")
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

    async def _events(self) -> AsyncIterator[tuple[dict | None, bool]]:
        """D's events, checked: an error event, a bad finish or a stream cut short before
        ``[DONE]`` raises ``TransferFailed`` naming the transfer."""
        try:
            async for line in self._all_lines():
                if line.strip() == "data: [DONE]":
                    yield None, True
                    return
                event = sse_event(line)
                if event is None:
                    continue
                error = event_error(event)
                if error is not None:
                    raise self._failed(f"failed: {error.get('message', '')}{WHERE_TO_LOOK}")
                bad = finished_badly(event)
                if bad is not None:
                    raise self._failed(f"ended the request with finish_reason {bad!r}{WHERE_TO_LOOK}")
                yield event, False
        except self.proxy._httpx.HTTPError as exc:
            error = self.proxy._call_error(exc, f"decode {self.decode.name}", self.transfer_id, True)
            if isinstance(error, TransferFailed):
                raise error from None
            raise self._failed(f"broke off its stream: {error}") from None
        finally:
            await self.reply.aclose()
        raise self._failed("ended its stream without [DONE]")

    async def events(self) -> AsyncIterator[bytes]:
        """D's server-sent events for the client; a failure becomes a last error event."""
        outcome = "failed"
        try:
            async for event, done in self._events():
                if done:
                    outcome = "completed"
                    yield b"data: [DONE]\n\n"
                    return
                yield ("data: " + json.dumps(event) + "\n\n").encode()
        except TransferFailed as exc:
            log.warning("proxy.transfer_failed", transfer=self.transfer_id, why=exc.message)
            yield ("data: " + json.dumps(exc.body()) + "\n\n").encode()
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"           # the client went away; D's request is closed
            raise
        finally:
            self.proxy.count(outcome)
            if outcome == "completed":
                self.decode.served += 1
