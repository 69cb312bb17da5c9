"""The P/D proxy's HTTP front: FastAPI routes over ``Proxy``, and the uvicorn server for it.

``POST /v1/completions`` (streamed or not), ``GET /health`` and ``GET /v1/models``.
Rules: a body over ``max_body_bytes`` is refused (413) before it is parsed, one slower than
``body_timeout_s`` is cut (408), JSON nested too deep is a 400, and so is a value that cannot
go on to P and D (``proxy.check_values``); a client that leaves mid-body is counted, never a
traceback; any failure answers JSON naming its transfer (never a bare 500), and a client that
goes away ends its P and D requests (vLLM then aborts them). ``uvicorn_server`` adds the
connection cap and the head deadline (``connections.py``).
"""

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from ..logs import get_logger
from .connections import ConnectionGuard
from .instances import ProxyConfig, ProxyConfigError
from .proxy import Proxy, TransferFailed
from .proxy_tracing import RequestTrace

log = get_logger("moriio_fsm.serving.proxy")

#: How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


class ClientLeft(Exception):
    """The client closed its connection before its whole body arrived."""


class BodyTooSlow(TransferFailed):
    """The body took longer than ``body_timeout_s`` to arrive (408)."""


async def _read_raw(request, limit: int) -> bytes:
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TransferFailed(
            413,
            f"the request body has {declared} bytes; at most {limit} are taken",
            "invalid_request_error",
        )
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TransferFailed(
                    413, f"the request body is over {limit} bytes", "invalid_request_error"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientLeft() from None
    return b"".join(chunks)


async def read_body(request, limit: int, timeout_s: float) -> Any:
    """The request's JSON, at most ``limit`` bytes arriving within ``timeout_s``:
    ``TransferFailed`` (413, 400, ``BodyTooSlow``) or ``ClientLeft`` if not. NaN and the
    infinities parse here, so that ``check_values`` refuses them naming their field."""
    try:
        raw = await asyncio.wait_for(_read_raw(request, limit), timeout_s)
    except TimeoutError:
        raise BodyTooSlow(
            408,
            f"the request body did not arrive within {timeout_s:g}s (the proxy's body_timeout_s)",
            "timeout",
        ) from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TransferFailed(
            400,
            f"the request body is not JSON the proxy accepts: "
            f"{type(exc).__name__}: {str(exc)[:200]}",
            "invalid_request_error",
        ) from None


def build_app(config: ProxyConfig, guard: ConnectionGuard | None = None):
    """The ASGI app serving ``config``; with ``guard``, it tells the guard when each request
    is served. ``uvicorn_server`` passes one; served any other way, the app keeps its body
    timeout but has no connection cap and no head deadline."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request

    holder: dict[str, Proxy] = {}

    @asynccontextmanager
    async def lifespan(app):
        proxy = holder["proxy"] = Proxy(config)
        prober = asyncio.ensure_future(proxy.probe_forever())
        try:
            yield
        finally:
            prober.cancel()
            await proxy.close()

    app = FastAPI(title="moriio-fsm P/D proxy", lifespan=lifespan)
    app.state.holder = holder

    async def completions(request: Request):
        return await _complete(holder["proxy"], config, request)

    async def health():
        return _health(holder["proxy"], guard)

    async def models():
        return await _models(holder["proxy"])

    app.post("/v1/completions")(completions)
    app.get("/health")(health)
    app.get("/v1/models")(models)
    return app if guard is None else guard.middleware(app)


async def _complete(proxy: Proxy, config: ProxyConfig, request):
    """``POST /v1/completions``: the body read within its limits, then D's answer, whole or
    streamed; 499 (nobody reads it) when the client leaves first. The client's trace
    context goes on to P and D (``proxy_tracing.py``)."""
    trace = RequestTrace(request.headers, config.otel)
    return trace.finish(await _routed(proxy, config, request))


async def _routed(proxy: Proxy, config: ProxyConfig, request):
    from fastapi.responses import Response

    try:
        body = await read_body(request, config.max_body_bytes, config.body_timeout_s)
    except ClientLeft:
        for outcome in ("requests", "cancelled", "left_mid_body"):
            proxy.count(outcome)
        return Response(status_code=499)
    except TransferFailed as exc:
        return _refused_body(proxy, exc)
    work = asyncio.ensure_future(_whole_answer(proxy, body))
    if not await _done_before_client_left(work, request):
        proxy.count("cancelled")
        return Response(status_code=499)
    return _answer(proxy, work, request)


def _refused_body(proxy: Proxy, exc: TransferFailed):
    """A body refused before routing (too big, too slow, not JSON): counted, answered, and
    the connection closed when the rest of the body was left unread."""
    proxy.count("requests")
    proxy.count("rejected")
    if isinstance(exc, BodyTooSlow):
        proxy.count("body_timeouts")
    return _failure(exc, close=exc.status in (408, 413))


async def _done_before_client_left(work: asyncio.Future, request) -> bool:
    """Wait for ``work`` or for the client to leave; if the client left first, cancel
    ``work`` (closing P's and D's requests aborts them) and say False."""
    gone = asyncio.ensure_future(_until_gone(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        return False
    return True


def _answer(proxy: Proxy, work: asyncio.Future, request):
    """The client's response from a finished ``work``: D's answer, or JSON naming the failure."""
    from fastapi.responses import JSONResponse, StreamingResponse

    try:
        transfer_id, answer = work.result()
    except TransferFailed as exc:
        return _failure(exc)
    except Exception as exc:  # a bug of ours must still answer JSON, and be seen
        log.error("proxy.internal_error", error=f"{type(exc).__name__}: {exc}")
        proxy.count("failed")
        return _failure(
            TransferFailed(500, f"the proxy failed: {type(exc).__name__}: {exc}", "internal_error")
        )
    headers = {"x-transfer-id": transfer_id}
    if isinstance(answer, dict):
        return JSONResponse(answer, headers=headers)
    events = _while_client_stays(answer.events(), request)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _while_client_stays(events: AsyncIterator[bytes], request) -> AsyncIterator[bytes]:
    """``events`` until the client leaves, noticed even while no event is due (D still
    loading after P's first token went out): then the answer is closed, which closes D's."""
    gone = asyncio.ensure_future(_until_gone(request))
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return
            try:
                chunk = step.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        gone.cancel()
        if step is not None and not step.done():
            # Cancelled once and not awaited: the answer then closes itself (and D's request)
            # without being cancelled again half-way, as awaiting here under anyio would.
            step.cancel()
        else:
            await events.aclose()  # type: ignore[attr-defined]


def _failure(exc: TransferFailed, close: bool = False):
    from fastapi.responses import JSONResponse

    headers = {"x-transfer-id": exc.transfer_id} if exc.transfer_id else {}
    if close:  # a body left unread: the connection cannot go on
        headers["connection"] = "close"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _until_gone(request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _whole_answer(proxy: Proxy, body: Any) -> tuple[str, Any]:
    reply = await proxy.complete(body)
    if not reply.stream:
        return reply.transfer_id, await reply.json()
    return reply.transfer_id, reply


def _health(proxy: Proxy, guard: ConnectionGuard | None):
    """``GET /health``: the proxy's health, and with a guard its connections."""
    from fastapi.responses import JSONResponse

    status, body = proxy.health()
    if guard is not None:
        body["connections"] = guard.describe()
    return JSONResponse(body, status_code=status)


async def _models(proxy: Proxy):
    """``GET /v1/models``: the first decode instance that answers says; one that cannot be
    reached is marked down and the next one asked."""
    from fastapi.responses import JSONResponse

    tried: set[str] = set()
    while (decode := proxy.decode.pick(exclude=tried)) is not None:
        tried.add(decode.name)
        try:
            reply = await proxy.client.get(f"{decode.url}/v1/models")
            return JSONResponse(reply.json(), status_code=reply.status_code)
        except Exception as exc:
            proxy.decode.mark_down(decode, f"{type(exc).__name__}: {exc}")
    return _failure(
        TransferFailed(
            503,
            f"no decode instance is available ({proxy.decode.unavailable()})",
            "service_unavailable",
        )
    )


def uvicorn_server(config: ProxyConfig, host: str, port: int, log_level: str = "warning"):
    """A uvicorn server for the proxy, with ``config``'s connection cap and head deadline."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    guard = ConnectionGuard(config.max_connections, config.header_timeout_s)
    # The guard finds a request's connection by its client address: take it from the
    # socket, never from X-Forwarded-For. The guard's head deadline closes idle
    # keep-alive connections, so uvicorn's own keep-alive timeout must not come first.
    return uvicorn.Server(
        uvicorn.Config(
            build_app(config, guard),
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            # uvicorn's annotation asks for a protocol class for ``http``, but it only calls it (with
            # keyword arguments) to make each connection's protocol: a factory serves as well.
            http=guard.protocol_factory(AutoHTTPProtocol),  # type: ignore[arg-type]
            proxy_headers=False,
            timeout_keep_alive=math.ceil(config.header_timeout_s) + 1,
            timeout_graceful_shutdown=5,
        )
    )


class ProxyServer:
    """The proxy served by uvicorn on a background thread (the demo's and the tests' way)."""

    def __init__(self, config: ProxyConfig, port: int, host: str = "127.0.0.1"):
        self.port, self.host = port, host
        self.server = uvicorn_server(config, host, port)
        self.thread = threading.Thread(target=self.server.run, name="moriio-fsm-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "ProxyServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ProxyConfigError(
                    f"the proxy could not listen on {self.url} (is the port "
                    "taken? uvicorn's log above says why)"
                )
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(5)
