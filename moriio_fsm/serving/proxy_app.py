"""The P/D proxy's HTTP front: FastAPI routes over ``Proxy``, and a server on a thread.

``POST /v1/completions`` (streamed or not), ``GET /health`` and ``GET /v1/models``.
Rules: a body over ``max_body_bytes`` is refused (413) before it is parsed, JSON with NaN
or nesting too deep is a 400, any failure answers JSON naming its transfer (never a bare
500), and a client that goes away ends its P and D requests (vLLM then aborts them).
"""


import asyncio
import json
import threading
import time
from typing import Any

from ..logs import get_logger
from .instances import ProxyConfig, ProxyConfigError
from .proxy import Proxy, TransferFailed

log = get_logger("moriio_fsm.serving.proxy")

#: How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def read_body(request, limit: int) -> Any:
    """The request's JSON, read at most ``limit`` bytes; ``TransferFailed`` (413/400) if not."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TransferFailed(413, f"the request body has {declared} bytes; at most {limit} are taken",
                             "invalid_request_error")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TransferFailed(413, f"the request body is over {limit} bytes", "invalid_request_error")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks), parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise TransferFailed(400, f"the request body is not JSON the proxy accepts: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}", "invalid_request_error") from None


def build_app(config: ProxyConfig):
    """The FastAPI app serving ``config``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

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

    def failure(exc: TransferFailed) -> JSONResponse:
        headers = {"x-transfer-id": exc.transfer_id} if exc.transfer_id else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def until_gone(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def whole_answer(body: Any) -> tuple[str, Any]:
        reply = await holder["proxy"].complete(body)
        if not reply.stream:
            return reply.transfer_id, await reply.json()
        return reply.transfer_id, reply

    async def completions(request: Request):
        proxy = holder["proxy"]
        try:
            body = await read_body(request, config.max_body_bytes)
        except TransferFailed as exc:
            proxy.count("requests")
            proxy.count("rejected")
            return failure(exc)
        work = asyncio.ensure_future(whole_answer(body))
        gone = asyncio.ensure_future(until_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():                 # the client left: closing P's and D's requests aborts them
            work.cancel()
            proxy.count("cancelled")
            return Response(status_code=499)
        try:
            transfer_id, answer = work.result()
        except TransferFailed as exc:
            return failure(exc)
        except Exception as exc:            # a bug of ours must still answer JSON, and be seen
            log.error("proxy.internal_error", error=f"{type(exc).__name__}: {exc}")
            proxy.count("failed")
            return failure(TransferFailed(500, f"the proxy failed: {type(exc).__name__}: {exc}",
                                          "internal_error"))
        headers = {"x-transfer-id": transfer_id}
        if isinstance(answer, dict):
            return JSONResponse(answer, headers=headers)
        return StreamingResponse(answer.events(), media_type="text/event-stream", headers=headers)

    app.post("/v1/completions")(completions)

    async def health():
        status, body = holder["proxy"].health()
        return JSONResponse(body, status_code=status)

    app.get("/health")(health)

    async def models():
        proxy = holder["proxy"]
        tried: set[str] = set()
        while (decode := proxy.decode.pick(exclude=tried)) is not None:
            tried.add(decode.name)
            try:
                reply = await proxy.client.get(f"{decode.url}/v1/models")
                return JSONResponse(reply.json(), status_code=reply.status_code)
            except Exception as exc:
                proxy.decode.mark_down(decode, f"{type(exc).__name__}: {exc}")
        return failure(TransferFailed(503, f"no decode instance is available "
                                           f"({proxy.decode.unavailable()})", "service_unavailable"))

    app.get("/v1/models")(models)
    return app


class ProxyServer:
    """The proxy served by uvicorn on a background thread (the demo's and the tests' way)."""

    def __init__(self, config: ProxyConfig, port: int, host: str = "127.0.0.1"):
        import uvicorn

        self.port, self.host = port, host
        self.server = uvicorn.Server(uvicorn.Config(build_app(config), host=host, port=port,
                                                    log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=5))
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
                raise ProxyConfigError(f"the proxy could not listen on {self.url} (is the port "
                                       "taken? uvicorn's log above says why)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(5)
