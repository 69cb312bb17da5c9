"""The P/D proxy: an OpenAI-compatible front that splits each completion into P's part and D's.

Every request gets one transfer id. In WRITE mode P (``max_tokens=1``) and D are asked at
once, each told where the other's connector listens; in READ mode D is asked after P
answered, with the ``kv_transfer_params`` P returned. D's answer (streamed or not) goes
back to the client. Rules: the client never gets a silent wrong answer (a failed transfer
is an HTTP error naming the transfer); an instance that cannot be reached is marked down,
skipped, and probed until it answers again; a request whose prefill instance failed before
D produced anything is retried on the next one with a new transfer id.
"""


import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..errors import MoriioFsmError

log = logging.getLogger("moriio_fsm.serving.proxy")

MODES = ("write", "read")


class ProxyConfigError(MoriioFsmError, ValueError):
    """An instance spec or a proxy setting that cannot be used."""


@dataclass
class Instance:
    """One vLLM server behind the proxy; ``kv`` is where its connector listens (WRITE mode)."""

    name: str
    url: str
    kv_host: str | None = None
    notify_port: int | None = None
    handshake_port: int | None = None
    up: bool = True
    down_since: float | None = None
    last_error: str = ""
    served: int = 0

    @classmethod
    def parse(cls, name: str, spec: str) -> "Instance":
        """``URL`` or ``URL,kv=HOST:NOTIFY_PORT:HANDSHAKE_PORT``."""
        url, _, kv = spec.partition(",kv=")
        if not url.startswith(("http://", "https://")):
            raise ProxyConfigError(f"instance {name}: expected URL[,kv=HOST:NOTIFY:HANDSHAKE] "
                                   f"with an http:// URL, got {spec!r}")
        if not kv:
            return cls(name, url.rstrip("/"))
        parts = kv.split(":")
        if len(parts) != 3 or not all(p.isdigit() and 0 < int(p) < 65536 for p in parts[1:]):
            raise ProxyConfigError(f"instance {name}: kv= expects HOST:NOTIFY_PORT:HANDSHAKE_PORT "
                                   f"with ports in 1-65535, got {kv!r}")
        return cls(name, url.rstrip("/"), parts[0], int(parts[1]), int(parts[2]))

    def peer_params(self) -> dict[str, Any]:
        """What the other side's connector needs to reach this instance's connector."""
        return {"remote_host": self.kv_host, "remote_notify_port": self.notify_port,
                "remote_handshake_port": self.handshake_port}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "up": self.up, "served": self.served,
                "down_since": self.down_since, "last_error": self.last_error}


class Pool:
    """Round robin over the instances of one role, skipping those marked down."""

    def __init__(self, role: str, instances: list[Instance]):
        if not instances:
            raise ProxyConfigError(f"the proxy needs at least one {role} instance")
        self.role = role
        self.instances = instances
        self._next = 0
        self._lock = threading.Lock()

    def pick(self, exclude: set[str] = frozenset()) -> Instance | None:
        with self._lock:
            for offset in range(len(self.instances)):
                candidate = self.instances[(self._next + offset) % len(self.instances)]
                if candidate.up and candidate.name not in exclude:
                    self._next = (self._next + offset + 1) % len(self.instances)
                    return candidate
        return None

    def mark_down(self, instance: Instance, why: str) -> None:
        with self._lock:
            if instance.up:
                log.warning("%s %s (%s) is down: %s", self.role, instance.name, instance.url, why)
                instance.up, instance.down_since = False, time.time()
            instance.last_error = why

    def unavailable(self) -> str:
        return "; ".join(f"{i.name} ({i.url}) down: {i.last_error or 'unknown'}"
                         for i in self.instances if not i.up) or "none configured"


@dataclass
class ProxyConfig:
    mode: str
    prefills: list[Instance]
    decodes: list[Instance]
    request_timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    probe_interval_s: float = 2.0
    extra_prefill_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ProxyConfigError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        for value, name in ((self.request_timeout_s, "request_timeout_s"),
                            (self.connect_timeout_s, "connect_timeout_s"),
                            (self.probe_interval_s, "probe_interval_s")):
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ProxyConfigError(f"{name}: expected a positive finite number of seconds, "
                                       f"got {value!r}")
        if self.mode == "write":
            for instance in self.prefills + self.decodes:
                if instance.notify_port is None:
                    raise ProxyConfigError(
                        f"instance {instance.name}: WRITE mode needs where its connector listens "
                        f"(URL,kv=HOST:NOTIFY_PORT:HANDSHAKE_PORT), got only {instance.url}")


class TransferFailed(Exception):
    """A request's transfer failed: the HTTP status and the message the client gets."""

    def __init__(self, status: int, message: str, kind: str = "kv_transfer_failed"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _Unreachable(Exception):
    """An instance could not be reached (refused, reset, timed out): mark it down."""


def _error_body(message: str, kind: str, transfer_id: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "transfer_id": transfer_id}}


class Proxy:
    """The routing logic, independent of the HTTP framework that serves it."""

    def __init__(self, config: ProxyConfig):
        import httpx

        self.config = config
        self.prefill = Pool("prefill", config.prefills)
        self.decode = Pool("decode", config.decodes)
        self.counts = {"requests": 0, "completed": 0, "failed": 0, "retried": 0, "rejected": 0}
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256))
        self._httpx = httpx

    async def close(self) -> None:
        await self.client.aclose()

    # -- health ------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        body = {"mode": self.config.mode, "counts": dict(self.counts),
                "prefill": [i.describe() for i in self.prefill.instances],
                "decode": [i.describe() for i in self.decode.instances]}
        ready = any(i.up for i in self.prefill.instances) and any(i.up for i in self.decode.instances)
        return (200 if ready else 503), body

    async def probe_forever(self) -> None:
        """Bring instances marked down back once their ``/health`` answers."""
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            for pool in (self.prefill, self.decode):
                for instance in pool.instances:
                    if not instance.up and await self._healthy(instance):
                        log.info("%s %s (%s) is up again", pool.role, instance.name, instance.url)
                        instance.up, instance.down_since = True, None

    async def _healthy(self, instance: Instance) -> bool:
        try:
            reply = await self.client.get(f"{instance.url}/health", timeout=2.0)
            return reply.status_code == 200
        except self._httpx.HTTPError:
            return False

    # -- one completion ----------------------------------------------------------------------

    def check_request(self, body: Any) -> None:
        """Refuse what the proxy cannot route, naming the field."""
        if not isinstance(body, dict):
            raise TransferFailed(400, f"the request body must be a JSON object, got "
                                      f"{type(body).__name__}", "invalid_request_error")
        if "prompt" not in body:
            raise TransferFailed(400, "the request has no 'prompt'", "invalid_request_error")
        if "kv_transfer_params" in body:
            raise TransferFailed(400, "'kv_transfer_params' is set by the proxy; leave it out",
                                 "invalid_request_error")
        if not isinstance(body.get("stream", False), bool):
            raise TransferFailed(400, f"'stream' must be true or false, got {body['stream']!r}",
                                 "invalid_request_error")
        n = body.get("n", 1)
        if n != 1:
            raise TransferFailed(400, f"'n' must be 1 behind a P/D proxy, got {n!r}",
                                 "invalid_request_error")

    def _prefill_body(self, body: dict, transfer_id: str, decode: Instance) -> dict:
        part = dict(body, max_tokens=1, stream=False)
        part.pop("stream_options", None)
        part.pop("min_tokens", None)
        params = {"do_remote_decode": True, "transfer_id": transfer_id,
                  **self.config.extra_prefill_params}
        if self.config.mode == "write":
            params.update(decode.peer_params())
        part["kv_transfer_params"] = params
        return part

    def _decode_body(self, body: dict, transfer_id: str, prefill: Instance,
                     from_prefill: dict | None) -> dict:
        part = dict(body)
        if self.config.mode == "write":
            part["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id,
                                          **prefill.peer_params()}
        else:
            part["kv_transfer_params"] = from_prefill
        return part

    async def _post(self, instance: Instance, body: dict, request_id: str):
        try:
            return await self.client.post(f"{instance.url}/v1/completions", json=body,
                                          headers={"X-Request-Id": request_id})
        except (self._httpx.ConnectError, self._httpx.RemoteProtocolError,
                self._httpx.ReadError, self._httpx.WriteError, self._httpx.PoolTimeout,
                self._httpx.ConnectTimeout) as exc:
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from None

    async def _run_prefill(self, instance: Instance, body: dict, transfer_id: str) -> dict:
        """P's part; returns P's JSON, or raises _Unreachable / TransferFailed."""
        reply = await self._post(instance, body, transfer_id)
        if reply.status_code != 200:
            raise TransferFailed(502, f"transfer {transfer_id}: prefill {instance.name} "
                                      f"({instance.url}) answered {reply.status_code}: "
                                      f"{_short(reply.text)}")
        try:
            data = reply.json()
        except ValueError:
            raise TransferFailed(502, f"transfer {transfer_id}: prefill {instance.name} answered "
                                      f"something that is not JSON: {_short(reply.text)}") from None
        instance.served += 1
        return data

    async def _accept_prefill(self, instance: Instance, body: dict, transfer_id: str):
        """Open P's streamed part; returns once P answered 200 (it has the request)."""
        request = self.client.build_request("POST", f"{instance.url}/v1/completions", json=body,
                                            headers={"X-Request-Id": transfer_id})
        try:
            reply = await self.client.send(request, stream=True)
        except (self._httpx.ConnectError, self._httpx.RemoteProtocolError,
                self._httpx.ReadError, self._httpx.WriteError, self._httpx.PoolTimeout,
                self._httpx.ConnectTimeout) as exc:
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from None
        if reply.status_code != 200:
            try:
                text = (await reply.aread()).decode(errors="replace")
            finally:
                await reply.aclose()
            raise TransferFailed(502, f"transfer {transfer_id}: prefill {instance.name} "
                                      f"({instance.url}) answered {reply.status_code}: {_short(text)}")
        return reply

    async def _finish_prefill(self, instance: Instance, reply, transfer_id: str) -> None:
        """Read P's stream to its end; an error event or a broken stream fails the part."""
        try:
            async for line in reply.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    raise TransferFailed(502, f"transfer {transfer_id}: prefill {instance.name} "
                                              f"failed: {_short(line[6:])}")
        except self._httpx.HTTPError as exc:
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from None
        finally:
            await reply.aclose()
        instance.served += 1

    async def complete(self, body: Any) -> tuple[str, "Answer"]:
        """Route one completion; returns its transfer id and D's answer (a stream or JSON)."""
        self.counts["requests"] += 1
        try:
            self.check_request(body)
        except TransferFailed:
            self.counts["rejected"] += 1
            raise
        tried: set[str] = set()
        last_error = ""
        while True:
            prefill = self.prefill.pick(exclude=tried)
            decode = self.decode.pick()
            if prefill is None or decode is None:
                pool = self.prefill if prefill is None else self.decode
                self.counts["failed"] += 1
                raise TransferFailed(503, f"no {pool.role} instance is available ({pool.unavailable()})"
                                          + (f"; last attempt: {last_error}" if last_error else ""),
                                     "service_unavailable")
            transfer_id = f"tx-{uuid.uuid4().hex}"
            try:
                answer = await self._attempt(body, transfer_id, prefill, decode)
            except _PrefillDown as exc:
                tried.add(prefill.name)
                self.prefill.mark_down(prefill, exc.why)
                self.counts["retried"] += 1
                last_error = f"transfer {transfer_id}: prefill {prefill.name} unreachable ({exc.why})"
                continue
            except TransferFailed:
                self.counts["failed"] += 1
                raise
            return transfer_id, answer

    async def _attempt(self, body: dict, transfer_id: str, prefill: Instance,
                       decode: Instance) -> "Answer":
        stream = bool(body.get("stream", False))
        p_body = self._prefill_body(body, transfer_id, decode)
        if self.config.mode == "read":
            try:
                p_reply = await self._run_prefill(prefill, p_body, transfer_id)
            except _Unreachable as exc:
                raise _PrefillDown(str(exc)) from None
            params = p_reply.get("kv_transfer_params") if isinstance(p_reply, dict) else None
            if not isinstance(params, dict):
                raise TransferFailed(502, f"transfer {transfer_id}: prefill {prefill.name} returned no "
                                          "kv_transfer_params (is its connector a kv_producer in "
                                          "READ mode?)")
            d_body = self._decode_body(body, transfer_id, prefill, params)
            return await self._open_decode(decode, d_body, transfer_id, stream, None)
        # WRITE: D is asked once P accepted its part (P's stream opened), so that D never
        # waits for, and holds blocks against, a P that never got the request; then both
        # run at once: D waits for P's writes, P for D's block ids.
        try:
            p_reply = await self._accept_prefill(prefill, dict(p_body, stream=True), transfer_id)
        except _Unreachable as exc:
            raise _PrefillDown(str(exc)) from None
        p_task = asyncio.ensure_future(self._finish_prefill(prefill, p_reply, transfer_id))
        # P's failure after D answered changes nothing for the client: note it as seen.
        p_task.add_done_callback(lambda task: task.cancelled() or task.exception())
        d_body = self._decode_body(body, transfer_id, prefill, None)
        try:
            return await self._open_decode(decode, d_body, transfer_id, stream, p_task)
        except BaseException:
            if not p_task.done():
                p_task.cancel()             # closing P's request makes vLLM abort it
            raise

    async def _open_decode(self, decode: Instance, body: dict, transfer_id: str, stream: bool,
                           p_task: asyncio.Future | None) -> "Answer":
        """Send D its part; in WRITE mode watch P's part meanwhile, so that a P that fails
        first ends D's request instead of leaving D to wait for writes that never come."""
        request = self.client.build_request("POST", f"{decode.url}/v1/completions", json=body,
                                            headers={"X-Request-Id": transfer_id})
        send = asyncio.ensure_future(self.client.send(request, stream=True))
        try:
            if p_task is not None:
                await asyncio.wait({send, p_task}, return_when=asyncio.FIRST_COMPLETED)
                if p_task.done() and not send.done():
                    _raise_prefill_error(p_task)       # P failed before D answered
            try:
                reply = await send
            except (self._httpx.ConnectError, self._httpx.ConnectTimeout) as exc:
                self.decode.mark_down(decode, f"{type(exc).__name__}: {exc}")
                raise TransferFailed(502, f"transfer {transfer_id}: decode {decode.name} "
                                          f"({decode.url}) unreachable: {exc}") from None
            except self._httpx.HTTPError as exc:
                raise TransferFailed(502, f"transfer {transfer_id}: decode {decode.name} "
                                          f"({decode.url}) failed: {type(exc).__name__}: {exc}") from None
        except BaseException:
            if not send.done():
                send.cancel()
            elif not send.cancelled() and send.exception() is None:
                await send.result().aclose()
            raise
        answer = Answer(self, reply, decode, transfer_id, stream, p_task)
        if stream and p_task is not None and reply.status_code == 200:
            await answer.prime()
        return answer


class _PrefillDown(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _raise_prefill_error(p_task: asyncio.Future) -> None:
    error = p_task.exception()
    if isinstance(error, _Unreachable):
        raise _PrefillDown(str(error))
    if error is not None:
        raise error


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


#: What a D failure most often means behind this proxy, and where its story is.
WHERE_TO_LOOK = (" (D could not load the prompt's KV cache, or its engine failed; "
                 "`moriio-fsm explain` on D's and P's connector traces with --transfer "
                 "shows what happened to the transfer)")


class Answer:
    """D's open reply: read it whole (``json``) or pass its events on (``events``)."""

    def __init__(self, proxy: Proxy, reply, decode: Instance, transfer_id: str, stream: bool,
                 p_task: asyncio.Future | None):
        self.proxy, self.reply, self.decode = proxy, reply, decode
        self.transfer_id, self.stream, self.p_task = transfer_id, stream, p_task
        self._lines = reply.aiter_lines()
        self._primed: list[str] = []

    async def prime(self) -> None:
        """Hold D's stream until its first line or P's failure, whichever comes first: a
        P that fails before D said anything is retried (D's headers come at once, so the
        status alone cannot tell)."""
        first = asyncio.ensure_future(self._lines.__anext__())
        try:
            await asyncio.wait({first, self.p_task}, return_when=asyncio.FIRST_COMPLETED)
            if self.p_task.done() and not first.done() and self.p_task.exception() is not None:
                _raise_prefill_error(self.p_task)
            try:
                self._primed.append(await first)
            except StopAsyncIteration:
                pass
        except BaseException:
            if not first.done():
                first.cancel()
            await self.reply.aclose()
            raise

    def _failure(self, status: int, text: str) -> TransferFailed:
        return TransferFailed(502 if status >= 500 else status,
                              f"transfer {self.transfer_id}: decode {self.decode.name} "
                              f"({self.decode.url}) answered {status}: {_short(text)}"
                              + (WHERE_TO_LOOK if status >= 500 else ""),
                              "kv_transfer_failed" if status >= 500 else "invalid_request_error")

    async def _settle_prefill(self) -> None:
        """P's part must have succeeded for D's answer to count (WRITE: both ran at once)."""
        if self.p_task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.p_task), self.proxy.config.request_timeout_s)
        except (_Unreachable, TransferFailed, asyncio.TimeoutError):
            pass        # D answered: it either got P's KV or recomputed/failed on its own

    async def json(self) -> dict[str, Any]:
        try:
            raw = await self.reply.aread()
        finally:
            await self.reply.aclose()
        text = raw.decode(errors="replace")
        if self.reply.status_code != 200:
            self.proxy.counts["failed"] += 1
            raise self._failure(self.reply.status_code, text)
        await self._settle_prefill()
        try:
            data = json.loads(text)
        except ValueError:
            self.proxy.counts["failed"] += 1
            raise TransferFailed(502, f"transfer {self.transfer_id}: decode {self.decode.name} "
                                      f"answered something that is not JSON: {_short(text)}") from None
        if _finished_with_error(data):
            self.proxy.counts["failed"] += 1
            raise TransferFailed(502, f"transfer {self.transfer_id}: decode {self.decode.name} "
                                      "ended the request with an error")
        self.decode.served += 1
        self.proxy.counts["completed"] += 1
        return data

    async def first_error(self) -> TransferFailed | None:
        """A D that refused the request outright (not 200) fails before any byte is sent."""
        if self.reply.status_code == 200:
            return None
        try:
            text = (await self.reply.aread()).decode(errors="replace")
        finally:
            await self.reply.aclose()
        self.proxy.counts["failed"] += 1
        return self._failure(self.reply.status_code, text)

    async def events(self) -> AsyncIterator[bytes]:
        """D's server-sent events, with any error event given the transfer's id and cause."""
        failed = False
        try:
            async for line in _chain(self._primed, self._lines):
                if line.startswith("data: {") and '"error"' in line:
                    line, failed = self._annotate(line), True
                yield (line + "\n").encode()
        except self.proxy._httpx.HTTPError as exc:
            failed = True
            message = (f"transfer {self.transfer_id}: decode {self.decode.name} broke off the "
                       f"stream: {type(exc).__name__}: {exc}")
            yield ("data: " + json.dumps(_error_body(message, "kv_transfer_failed", self.transfer_id))
                   + "\n\n").encode()
        finally:
            await self.reply.aclose()
            self.proxy.counts["failed" if failed else "completed"] += 1
            if not failed:
                self.decode.served += 1
            await self._settle_prefill()

    def _annotate(self, line: str) -> str:
        try:
            event = json.loads(line[len("data: "):])
        except ValueError:
            return line
        error = event.get("error") if isinstance(event, dict) else None
        if not isinstance(error, dict):
            return line
        error["transfer_id"] = self.transfer_id
        error["message"] = (f"transfer {self.transfer_id}: decode {self.decode.name} failed: "
                            f"{error.get('message', '')}{WHERE_TO_LOOK}")
        return "data: " + json.dumps(event)


async def _chain(first: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for line in first:
        yield line
    async for line in rest:
        yield line


def _finished_with_error(data: Any) -> bool:
    choices = data.get("choices") if isinstance(data, dict) else None
    return isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") == "error" for c in choices)


def build_app(config: ProxyConfig):
    """The FastAPI app: ``POST /v1/completions``, ``GET /health``, ``GET /v1/models``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

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

    def failure(exc: TransferFailed, transfer_id: str | None = None) -> JSONResponse:
        return JSONResponse(_error_body(exc.message, exc.kind, transfer_id), status_code=exc.status,
                            headers={"x-transfer-id": transfer_id} if transfer_id else None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        proxy = holder["proxy"]
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            proxy.counts["requests"] += 1
            proxy.counts["rejected"] += 1
            return failure(TransferFailed(400, f"the request body is not JSON: {exc}",
                                          "invalid_request_error"))
        try:
            transfer_id, answer = await proxy.complete(body)
        except TransferFailed as exc:
            return failure(exc, _transfer_in(exc.message))
        headers = {"x-transfer-id": transfer_id}
        try:
            if not answer.stream:
                return JSONResponse(await answer.json(), headers=headers)
            refused = await answer.first_error()
            if refused is not None:
                return failure(refused, transfer_id)
        except TransferFailed as exc:
            return failure(exc, transfer_id)
        return StreamingResponse(answer.events(), media_type="text/event-stream", headers=headers)

    @app.get("/health")
    async def health():
        status, body = holder["proxy"].health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models():
        proxy = holder["proxy"]
        decode = proxy.decode.pick()
        if decode is None:
            return failure(TransferFailed(503, f"no decode instance is available "
                                               f"({proxy.decode.unavailable()})", "service_unavailable"))
        reply = await proxy.client.get(f"{decode.url}/v1/models")
        return JSONResponse(reply.json(), status_code=reply.status_code)

    return app


def _transfer_in(message: str) -> str | None:
    if message.startswith("transfer tx-"):
        return message.split()[1].rstrip(":")
    return None


class ProxyServer:
    """The proxy served by uvicorn on a background thread (the demo's and the tests' way)."""

    def __init__(self, config: ProxyConfig, port: int, host: str = "127.0.0.1"):
        import uvicorn

        self.port, self.host = port, host
        self.server = uvicorn.Server(uvicorn.Config(build_app(config), host=host, port=port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="moriio-fsm-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "ProxyServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ProxyConfigError(f"the proxy could not listen on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
