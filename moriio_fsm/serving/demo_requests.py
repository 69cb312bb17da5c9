"""The demo's requests: the single instance's reference answers, then every prompt sent
through the proxy, streamed, each ending as an ``Outcome`` (identical, mismatched or failed).

Prompts of one group go at once; a request that fails says why in its ``error``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .demo_options import DemoOptions, Prompt
from .launcher import PdDeployment, free_ports, usable_cores
from .vllm_server import ServerConfig, VllmServer


@dataclass
class Outcome:
    prompt: Prompt
    verdict: str  # identical | mismatched | failed
    transfer_id: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str = ""
    tokens: list[int] = field(default_factory=list)


async def _complete(client, url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    reply = await client.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    reply.raise_for_status()
    return reply.json()["choices"][0]["token_ids"]


async def _stream(
    client, url: str, model: str, prompt: Prompt, max_tokens: int, expected: list[int]
) -> Outcome:
    """One request through the proxy, streamed: TTFT is the first token's arrival."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt.tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "stream": True,
    }
    started = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            tid = reply.headers.get("x-transfer-id")
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                return Outcome(prompt, "failed", tid, error=_error_message(text, reply.status_code))
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(prompt, "failed", tid, error=str(event["error"].get("message")))
                for choice in event.get("choices", ()):
                    new = choice.get("token_ids") or []
                    if new and ttft is None:
                        ttft = time.perf_counter() - started
                    tokens.extend(new)
    except httpx.HTTPError as exc:  # the proxy itself went away: still a failure
        return Outcome(prompt, "failed", None, error=f"{type(exc).__name__}: {exc}")
    verdict = "identical" if tokens == expected else "mismatched"
    return Outcome(prompt, verdict, tid, ttft, time.perf_counter() - started, tokens=tokens)


def _error_message(text: str, status: int) -> str:
    try:
        return f"HTTP {status}: {json.loads(text)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {text[:300]}"


def _groups(prompts: list[Prompt]) -> list[list[tuple[int, Prompt]]]:
    groups: dict[int, list[tuple[int, Prompt]]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(prompt.group, []).append((index, prompt))
    return list(groups.values())


def reference_answers(
    model: str,
    prompts: list[Prompt],
    options: DemoOptions,
    log,
    after: Callable[[int, VllmServer], None] | None = None,
) -> list[list[int]]:
    """The single instance's greedy answers (the same server settings as P and D);
    ``after(i, server)`` is called once answer ``i`` is in."""
    import httpx

    (port,) = free_ports(1)
    core = usable_cores()[0]
    shape = PdDeployment(model, options.mode, options.workdir)  # P's and D's engine settings
    server = VllmServer(
        ServerConfig(
            "single",
            model,
            port,
            core,
            block_size=shape.block_size,
            kv_cache_bytes=shape.kv_cache_bytes,
            max_model_len=shape.max_model_len,
        ),
        options.workdir / "logs" / "single.log",
    )
    try:
        log(f"single instance: starting on {server.url} (core {core})")
        server.wait_ready(300)

        async def ask() -> list[list[int]]:
            answers = []
            async with httpx.AsyncClient(timeout=120) as client:
                for index, p in enumerate(prompts):
                    answers.append(
                        await _complete(client, server.url, model, p.tokens, options.max_tokens)
                    )
                    if after is not None:
                        after(index, server)
            return answers

        answers = asyncio.run(ask())
        log(f"single instance: {len(answers)} reference answers")
        return answers
    finally:
        server.stop()


async def send_all(
    proxy_url: str,
    model: str,
    prompts: list[Prompt],
    expected: list[list[int]],
    options: DemoOptions,
    on_half: Callable[[], None],
) -> list[Outcome]:
    """Every prompt through the proxy, group by group (a group at once); ``on_half`` is
    called before the middle group. The outcomes come in the prompts' order."""
    import httpx

    outcomes: list[Outcome | None] = [None] * len(prompts)
    groups = _groups(prompts)
    limit = httpx.Timeout(180.0, connect=5.0)
    async with httpx.AsyncClient(timeout=limit) as client:
        for number, group in enumerate(groups):
            if number == len(groups) // 2:
                on_half()
            results = await asyncio.gather(
                *(
                    _stream(client, proxy_url, model, p, options.max_tokens, expected[i])
                    for i, p in group
                )
            )
            for (index, _), result in zip(group, results):
                outcomes[index] = result
    return [o for o in outcomes if o is not None]


__all__ = ["Outcome", "reference_answers", "send_all"]
