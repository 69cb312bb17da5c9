"""What the servers hold after the demo's run, read off their /metrics: requests still
running or waiting, and KV blocks in use (a leak once the run has settled).

A metric that is missing, or a server that exited, is a ``DemoError``: never a zero. An idle
vLLM publishes no new figures, so a server that shows blocks in use with no request left is
sent one one-token request, whose step publishes what it holds now.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import TypedDict

from ..errors import MoriioFsmError
from .vllm_server import VllmServer, metric_value


class DemoError(MoriioFsmError, RuntimeError):
    """The demo could not measure what it reports (a metric missing, a server gone)."""


class Holding(TypedDict):
    """What a server holds after the run, read off its /metrics (``metrics``: the whole text)."""

    running: float
    waiting: float
    blocks_used: int
    metrics: str


def settle(servers: list[VllmServer], timeout_s: float) -> dict[str, Holding]:
    """Wait until no request is left and every KV block is back; what each server holds."""
    deadline = time.monotonic() + timeout_s
    probed: dict[str, float] = {}
    while True:
        held = {s.config.name: _holdings(s) for s in servers}
        if (
            all(
                h["running"] == 0 and h["waiting"] == 0 and h["blocks_used"] == 0
                for h in held.values()
            )
            or time.monotonic() > deadline
        ):
            return held
        for server in servers:
            h, now = held[server.config.name], time.monotonic()
            idle = h["running"] == 0 and h["waiting"] == 0
            if (
                idle
                and h["blocks_used"]
                and now - probed.get(server.config.name, 0.0) > PROBE_GAP_S
            ):
                probed[server.config.name] = now
                _step_once(server)
        time.sleep(0.5)


#: How often an idle server that still shows blocks in use is sent a refreshing request.
PROBE_GAP_S = 2.0


def _step_once(server: VllmServer) -> None:
    """One one-token request without a transfer: the engine steps and publishes its figures."""
    body = {"model": server.config.model, "prompt": [1, 2, 3], "max_tokens": 1}
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            reply.read()
    except OSError:
        pass  # the next reading says what it holds, or that it is gone


def _holdings(server: VllmServer) -> Holding:
    if server.process.poll() is not None:
        raise DemoError(
            f"{server.config.name} exited with {server.process.returncode} during the "
            f"run; its log {server.log_path} ends:\n{server.log_tail()}"
        )
    text = server.metrics()
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    ):
        if name not in text:
            raise DemoError(
                f"{server.config.name}'s /metrics has no {name}: cannot tell whether "
                "blocks or requests were left behind"
            )
    usage = metric_value(text, "vllm:kv_cache_usage_perc")
    blocks = _num_blocks(text)
    if blocks <= 0:
        raise DemoError(
            f"{server.config.name}'s /metrics gives no num_gpu_blocks in "
            "vllm:cache_config_info: cannot count blocks"
        )
    return {
        "running": metric_value(text, "vllm:num_requests_running"),
        "waiting": metric_value(text, "vllm:num_requests_waiting"),
        "blocks_used": round(usage * blocks),
        "metrics": text,
    }


def _num_blocks(metrics_text: str) -> int:
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            for part in line.split(","):
                if "num_gpu_blocks=" in part:
                    value = part.split("=", 1)[1].strip('"} ')
                    if value.isdigit():
                        return int(value)
    return 0


__all__ = ["DemoError", "Holding", "settle"]
