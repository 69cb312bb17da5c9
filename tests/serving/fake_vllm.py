"""A stand-in for a vLLM OpenAI server, for the proxy's tests: it records what it was sent
and answers as told (a completion, a stream, an HTTP error, an error event, a delay).

It speaks just enough of ``/v1/completions`` and ``/health`` to show what the proxy
forwards; the real engines are tested in tests/integration.
"""

import asyncio
import json
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from moriio_fsm.serving.launcher import free_ports


def free_port() -> int:
    return free_ports(1)[0]


class FakeVllm:
    """One fake server; ``behaviour`` may be changed between requests."""

    def __init__(self, name: str, tokens: list[int] | None = None):
        self.name = name
        self.port = free_port()
        self.tokens = tokens or [1, 2, 3]
        self.received: list[dict] = []
        self.received_headers: list[dict] = []  # each request's HTTP headers, lower-cased names
        self.status = 200
        self.delay_s = 0.0
        self.error_event = False  # stream: an error event instead of the tokens
        self.error_delay_s = 0.0  # ... sent after this long
        self.cut_stream = False  # stream: end without [DONE]
        self.odd_event: dict | None = None  # stream: this event first (a D gone wrong)
        self.text = "t"  # each token's text
        self.finish_reason = "length"  # a whole (not streamed) answer's
        self.reply_params: dict | None = {"remote_engine_id": name, "remote_block_ids": [4]}
        self.disconnected = 0
        self.answered = 0  # requests it began to answer (after any delay)
        self.last_body: dict = {}
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({}, status_code=200)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.received.append(body)
            self.received_headers.append(dict(request.headers))
            self.last_body = body
            if self.delay_s:
                waited = 0.0
                while waited < self.delay_s:
                    if await request.is_disconnected():
                        self.disconnected += 1
                        return JSONResponse({}, status_code=499)
                    await asyncio.sleep(0.02)
                    waited += 0.02
            self.answered += 1
            if self.status != 200:
                return JSONResponse(
                    {"error": {"message": f"{name} says no"}}, status_code=self.status
                )
            if body.get("stream"):
                return StreamingResponse(self._events(), media_type="text/event-stream")
            choice = {
                "text": None if self.text is None else self.text * len(self.tokens),
                "token_ids": self.tokens,
                "finish_reason": self.finish_reason,
            }
            if body.get("return_token_ids"):
                prompt = body.get("prompt")
                choice["prompt_token_ids"] = prompt if isinstance(prompt, list) else [11, 12]
            return JSONResponse(
                {
                    "id": f"cmpl-{name}",
                    "created": 1,
                    "model": body.get("model"),
                    "choices": [choice],
                    "kv_transfer_params": self.reply_params,
                    "server": name,
                    "usage": {"prompt_tokens": 3, "completion_tokens": len(self.tokens)},
                }
            )

        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"fake vLLM {name} did not start on port {self.port}")

    async def _events(self):
        if self.error_event:
            await asyncio.sleep(self.error_delay_s)
            yield (
                "data: "
                + json.dumps({"error": {"message": "Internal server error", "code": 500}})
                + "\n\n"
            )
            return
        if self.odd_event is not None:
            yield "data: " + json.dumps(self.odd_event) + "\n\n"
        for i, token in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            choice = {
                "index": 0,
                "text": self.text,
                "token_ids": [token],
                "finish_reason": "length" if last else None,
            }
            if i == 0 and self.last_body.get("return_token_ids"):
                choice["prompt_token_ids"] = self.last_body.get("prompt")
            yield "data: " + json.dumps({"id": "cmpl-1", "choices": [choice]}) + "\n\n"
            await asyncio.sleep(0.01)
        if self.cut_stream:
            return
        yield (
            "data: "
            + json.dumps(
                {
                    "id": "cmpl-1",
                    "choices": [],
                    "usage": self._usage(),
                }
            )
            + "\n\n"
        )
        yield "data: [DONE]\n\n"

    def _usage(self) -> dict:
        prompt = self.last_body.get("prompt")
        usage = {"completion_tokens": len(self.tokens)}
        if isinstance(prompt, list):  # a prompt of token ids: its length is known here
            usage["prompt_tokens"] = len(prompt)
        return usage

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self, notify: int = 7001, handshake: int = 7002) -> str:
        return f"{self.url},kv=127.0.0.1:{notify}:{handshake}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def post(proxy, body, **kw):
    return httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30, **kw)
