"""The P/D proxy's routing: each completion split into P's part and D's, one transfer id each.

In WRITE mode P (``max_tokens=1``) is asked first and D once P accepted (P's stream
opened), each told where the other's connector listens; then both run at once. In READ
mode D is asked after P answered, with the ``kv_transfer_params`` P returned; by default P's
first token goes to the client at once and D continues after it (``first_token.py``). D's
answer, streamed or not, goes back to the client. Rules: the client never gets a silent wrong
answer (a failed transfer, a cut stream or a timeout is an HTTP error or an error event
naming the transfer); only an instance that could not be reached is marked down; a
request whose P or D never saw it is retried on the next instance with a new transfer id.
The HTTP front is ``proxy_app.py``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from ..logs import get_logger
from . import first_token
from .decode_reply import DecodeReply, event_error, sse_event
from .early_reply import EarlyReply
from .failures import (
    WHERE_TO_LOOK,
    NeverSaw,
    TransferFailed,
    Unreachable,
    raise_prefill_error,
)
from .instances import Instance, Pool, ProxyConfig, ProxyConfigError
from .proxy_tracing import outgoing
from .request_checks import check_request

log = get_logger("moriio_fsm.serving.proxy")

__all__ = ["DecodeReply", "Instance", "Proxy", "ProxyConfig", "ProxyConfigError", "TransferFailed"]


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
        self.counts = {
            "requests": 0,
            "completed": 0,
            "failed": 0,
            "retried": 0,
            "rejected": 0,
            "cancelled": 0,
            "left_mid_body": 0,
            "body_timeouts": 0,
        }
        timeout = httpx.Timeout(
            config.request_timeout_s,
            connect=config.connect_timeout_s,
            pool=config.connect_timeout_s,
        )
        self.client = httpx.AsyncClient(
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=config.upstream_connections, max_keepalive_connections=64
            ),
        )
        # Probes have their own connections: a busy pool must not make instances look down.
        self.prober = httpx.AsyncClient(timeout=2.0)
        self.httpx = httpx
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
        body = {
            "mode": self.config.mode,
            "counts": dict(self.counts),
            "prefill": [i.describe() for i in self.prefill.instances],
            "decode": [i.describe() for i in self.decode.instances],
        }
        ready = any(i.up for i in self.prefill.instances) and any(
            i.up for i in self.decode.instances
        )
        return (200 if ready else 503), body

    async def probe_forever(self) -> None:
        """Bring instances marked down back once their ``/health`` answers."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            down = [
                (pool, i)
                for pool in (self.prefill, self.decode)
                for i in pool.instances
                if not i.up
            ]
            results = await asyncio.gather(
                *(self._healthy(i) for _, i in down), return_exceptions=True
            )
            for (pool, instance), healthy in zip(down, results):
                if healthy is True:
                    pool.mark_up(instance)

    async def _healthy(self, instance: Instance) -> bool:
        try:
            reply = await self.prober.get(f"{instance.url}/health")
            return reply.status_code == 200
        except Exception:  # whatever went wrong, the instance stays down
            return False

    # -- errors of a call to an instance -----------------------------------------------------

    def call_error(self, exc: Exception, who: str, transfer_id: str, sent: bool) -> Exception:
        """What an httpx error means: the instance never saw the request (retry elsewhere),
        died under it, is too slow, or the proxy itself is out of connections."""
        httpx = self.httpx
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return (
                Unreachable(f"{type(exc).__name__}: {exc}")
                if sent
                else NeverSaw(who, f"{type(exc).__name__}: {exc}")
            )
        if isinstance(exc, httpx.PoolTimeout):
            return TransferFailed(
                503,
                f"transfer {transfer_id}: the proxy has no free connection "
                f"to {who} (upstream_connections "
                f"{self.config.upstream_connections})",
                "service_unavailable",
                transfer_id,
            )
        if isinstance(exc, httpx.TimeoutException):
            return TransferFailed(
                504,
                f"transfer {transfer_id}: {who} sent nothing for "
                f"{self.config.request_timeout_s:.0f}s",
                "timeout",
                transfer_id,
            )
        if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            return Unreachable(f"{type(exc).__name__}: {exc}")
        return TransferFailed(
            502,
            f"transfer {transfer_id}: {who} failed: {type(exc).__name__}: {exc}",
            "kv_transfer_failed",
            transfer_id,
        )

    def _refused(
        self, instance: Instance, role: str, status: int, text: str, transfer_id: str
    ) -> TransferFailed:
        """An instance's non-200 answer: the client's mistake stays a 4xx, a failure a 502."""
        message = (
            f"transfer {transfer_id}: {role} {instance.name} ({instance.url}) answered "
            f"{status}: {_short(text)}"
        )
        if status < 500:
            return TransferFailed(status, message, "invalid_request_error", transfer_id)
        return TransferFailed(
            502,
            message + (WHERE_TO_LOOK if role == "decode" else ""),
            "kv_transfer_failed",
            transfer_id,
        )

    # -- one completion ----------------------------------------------------------------------

    async def complete(self, body: Any) -> DecodeReply | EarlyReply:
        """Route one completion; D's open reply, or ``TransferFailed`` naming the transfer."""
        self.count("requests")
        try:
            check_request(body)
        except TransferFailed:
            self.count("rejected")
            raise
        tried: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        last_error = ""
        while True:
            prefill = self.prefill.pick(exclude=tried["prefill"])
            decode = self.decode.pick(exclude=tried["decode"])
            if prefill is None or decode is None:
                pool = self.prefill if prefill is None else self.decode
                self.count("failed")
                raise TransferFailed(
                    503,
                    f"no {pool.role} instance is available ({pool.unavailable()})"
                    + (f"; last attempt: {last_error}" if last_error else ""),
                    "service_unavailable",
                )
            transfer_id = f"tx-{uuid.uuid4().hex}"
            try:
                return await self._attempt(body, transfer_id, prefill, decode)
            except NeverSaw as exc:
                instance, pool = (
                    (prefill, self.prefill)
                    if exc.role.startswith("prefill")
                    else (decode, self.decode)
                )
                tried[pool.role].add(instance.name)
                pool.mark_down(instance, exc.why)
                self.count("retried")
                last_error = (
                    f"transfer {transfer_id}: {pool.role} {instance.name} unreachable ({exc.why})"
                )
                log.warning(
                    "proxy.retry", transfer=transfer_id, instance=instance.name, why=exc.why
                )
            except TransferFailed as exc:
                self.count("failed")
                log.warning(
                    "proxy.transfer_failed",
                    transfer=transfer_id,
                    status=exc.status,
                    why=exc.message,
                )
                raise

    async def _attempt(
        self, body: dict, transfer_id: str, prefill: Instance, decode: Instance
    ) -> DecodeReply | EarlyReply:
        stream = bool(body.get("stream", False))
        p_body = dict(body, max_tokens=1, stream=self.config.mode == "write")
        for key in ("stream_options", "min_tokens"):
            p_body.pop(key, None)
        params = {
            "do_remote_decode": True,
            "transfer_id": transfer_id,
            **self.config.extra_prefill_params,
        }
        if self.config.mode == "write":
            params.update(decode.peer_params())
        p_body["kv_transfer_params"] = params
        d_body = dict(body)
        who = f"prefill {prefill.name}"
        if self.config.mode == "read":
            if self.config.first_token_from_prefill and first_token.serves(body):
                return await self._early(body, p_body, transfer_id, prefill, decode)
            _, d_body["kv_transfer_params"] = await self._read_prefill(prefill, p_body, transfer_id)
            return await self._open_decode(decode, d_body, transfer_id, stream, None)
        d_body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            **prefill.peer_params(),
        }
        # D is asked once P accepted its part, so that D never holds blocks against a P
        # that never got the request; then both run at once.
        p_reply = await self._open(prefill, who, p_body, transfer_id, "prefill")
        p_task = asyncio.ensure_future(self._finish_prefill(prefill, p_reply, transfer_id))
        self._background.add(p_task)
        p_task.add_done_callback(self._forget)
        try:
            return await self._open_decode(decode, d_body, transfer_id, stream, p_task)
        except BaseException:
            p_task.cancel()  # closing P's request makes vLLM abort it
            raise

    async def _early(
        self, body: dict, p_body: dict, transfer_id: str, prefill: Instance, decode: Instance
    ) -> DecodeReply | EarlyReply:
        """READ mode, P's first token ahead: P's answer, then a reply that sends that token
        first and asks D (this one, or the next when it never saw the request) after it."""
        stream = bool(body.get("stream", False))
        p_body = first_token.prefill_body(p_body)
        answer, params = await self._read_prefill(prefill, p_body, transfer_id)
        first = first_token.parse(answer)
        if first is None:  # P stopped at its first token: D makes the answer the plain way
            d_body = dict(body, kv_transfer_params=params)
            return await self._open_decode(decode, d_body, transfer_id, stream, None)
        d_body = first_token.decode_body(body, first, params)

        async def open_decode(tried: set[str]) -> DecodeReply:
            instance = decode if decode.name not in tried else self.decode.pick(exclude=tried)
            if instance is None:
                raise TransferFailed(
                    503,
                    f"transfer {transfer_id}: no decode instance is available to continue "
                    f"after P's first token ({self.decode.unavailable()})",
                    "service_unavailable",
                    transfer_id,
                )
            try:
                return await self._open_decode(instance, d_body, transfer_id, stream, None)
            except NeverSaw as exc:
                tried.add(instance.name)
                self.decode.mark_down(instance, exc.why)
                raise

        event = first_token.first_event(answer, first, body)
        return EarlyReply(self, transfer_id, stream, first, event, body, open_decode)

    def _forget(self, task: asyncio.Future) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # P failing after D answered changes nothing now

    async def _open(self, instance: Instance, who: str, body: dict, transfer_id: str, role: str):
        """Send ``body`` streamed; the open reply once its status is 200."""
        request = self.client.build_request(
            "POST",
            f"{instance.url}/v1/completions",
            json=body,
            headers={"X-Request-Id": transfer_id, **outgoing()},
        )
        try:
            reply = await self.client.send(request, stream=True)
        except self.httpx.HTTPError as exc:
            raise self.call_error(exc, who, transfer_id, sent=False) from None
        if reply.status_code != 200:
            try:
                text = (await reply.aread()).decode(errors="replace")
            except self.httpx.HTTPError:
                text = ""
            finally:
                await reply.aclose()
            raise self._refused(instance, role, reply.status_code, text, transfer_id)
        return reply

    async def _read_prefill(
        self, prefill: Instance, body: dict, transfer_id: str
    ) -> tuple[dict, dict]:
        """READ mode: P's whole answer, and the ``kv_transfer_params`` D needs from it."""
        who = f"prefill {prefill.name}"
        reply = await self._open(prefill, who, body, transfer_id, "prefill")
        try:
            raw = await reply.aread()
        except self.httpx.HTTPError as exc:
            error = self.call_error(exc, who, transfer_id, sent=True)
            if isinstance(error, Unreachable):
                self.prefill.mark_down(prefill, str(error))
                error = TransferFailed(
                    502,
                    f"transfer {transfer_id}: {who} died under the request ({error})",
                    "kv_transfer_failed",
                    transfer_id,
                )
            raise error from None
        finally:
            await reply.aclose()
        try:
            data = json.loads(raw)
        except ValueError:
            raise TransferFailed(
                502,
                f"transfer {transfer_id}: {who} answered something that is "
                f"not JSON: {_short(raw.decode(errors='replace'))}",
                "kv_transfer_failed",
                transfer_id,
            ) from None
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict):
            raise TransferFailed(
                502,
                f"transfer {transfer_id}: {who} returned no kv_transfer_params "
                "(is its connector a kv_producer in READ mode?)",
                "kv_transfer_failed",
                transfer_id,
            )
        prefill.served += 1
        return data, params

    async def _finish_prefill(self, instance: Instance, reply, transfer_id: str) -> None:
        """WRITE mode: read P's stream to its end; an error event or a cut stream fails it."""
        who = f"prefill {instance.name}"
        done = False
        try:
            async for line in reply.aiter_lines():
                error = event_error(sse_event(line))
                if error is not None:
                    raise TransferFailed(
                        502,
                        f"transfer {transfer_id}: {who} failed: "
                        f"{_short(str(error.get('message')))}",
                        "kv_transfer_failed",
                        transfer_id,
                    )
                done = done or line.strip() == "data: [DONE]"
        except self.httpx.HTTPError as exc:
            failure = self.call_error(exc, who, transfer_id, sent=True)
            if isinstance(failure, Unreachable):
                self.prefill.mark_down(instance, str(failure))
            raise failure from None
        finally:
            await reply.aclose()
        if not done:
            raise Unreachable(f"{who}'s stream ended without [DONE]")
        instance.served += 1

    async def _open_decode(
        self,
        decode: Instance,
        body: dict,
        transfer_id: str,
        stream: bool,
        p_task: asyncio.Future | None,
    ) -> DecodeReply:
        """Send D its part; in WRITE mode watch P's part meanwhile, so that a P that fails
        before D said anything ends D's request instead of leaving D waiting for writes."""
        if not stream:  # D always streams: a cut answer then shows
            body = dict(body, stream=True, stream_options={"include_usage": True})
        send = asyncio.ensure_future(
            self._open(decode, f"decode {decode.name}", body, transfer_id, "decode")
        )
        try:
            if p_task is not None:
                await asyncio.wait({send, p_task}, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and not send.done():
                    raise_prefill_error(p_task, transfer_id)
            # Shielded: a caller cancelled again and again (as anyio cancels) must not cancel
            # the send more than once, or httpx stops closing the connection half-way and D
            # goes on with a request nobody reads.
            reply = await asyncio.shield(send)
        except BaseException:
            if not send.done():
                send.cancel()
            elif not send.cancelled() and send.exception() is None:
                await send.result().aclose()
            raise
        answer = DecodeReply(self, reply, decode, transfer_id, stream, p_task)
        await answer.prime()
        return answer
