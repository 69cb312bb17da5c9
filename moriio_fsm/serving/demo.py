"""``moriio-fsm demo``: real P/D serving of a tiny Llama, checked token by token against one instance.

It makes a model with saved random weights (no download), asks a single vLLM instance
for the greedy answers, then starts P and D servers with the connector and the proxy,
sends the same prompts (short, several blocks, shared prefixes, concurrent) through the
proxy, and compares. With ``--faults RATE`` the connector loses, duplicates and delays
control messages, fails RDMA operations, and one P is killed mid-run: every request must
then match or fail with a clear error, and no block may be left behind. It ends with the
line ``requests=<n> identical=<n> mismatched=<n> failed=<n> leaked_blocks=<n>``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from ..errors import MoriioFsmError
from .launcher import PdDeployment, free_ports, usable_cores
from .proxy_app import ProxyServer
from .tiny_model import ModelError, make_tiny_llama_with
from .vllm_server import ServerConfig, ServerError, VllmServer, metric_value, vllm_cpu_python

BLOCK = 128
VOCAB = 1024
#: Timeouts of a fault run: short, so that a lost message ends its transfer in seconds.
FAULT_TIMEOUTS: dict[str, Any] = {
    "transfer_timeout": 4.0,
    "defer_timeout": 8.0,
    "recv_abort_timeout": 8.0,
    # READ: a lease must outlast D's read timeout plus its margin (4 + 2 here)
    "lease_s": 10.0,
    "machine_config": {
        "read_consumer": {
            "setup_timeout_s": 8.0,
            "read_timeout_s": 4.0,
            "renew_interval_s": 2.0,
            "lease_margin_s": 2.0,
            "abandon_timeout_s": 1.0,
        }
    },
}


class DemoError(MoriioFsmError, RuntimeError):
    """The demo could not measure what it reports (a metric missing, a server gone)."""


@dataclass
class DemoOptions:
    mode: str = "write"
    requests: int = 16
    faults: float = 0.0
    workdir: Path = Path("moriio-fsm-demo")
    seed: int = 0
    max_tokens: int = 16
    prefills: int | None = None  # default: 1, or 2 with faults (one is killed)
    failure_policy: str = "fail"
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("write", "read"):
            raise ValueError(f"--mode: expected write or read, got {self.mode!r}")
        if not isinstance(self.requests, int) or not 1 <= self.requests <= 10_000:
            raise ValueError(f"--requests: expected 1 to 10000, got {self.requests!r}")
        if not 0.0 <= self.faults <= 0.5:
            raise ValueError(f"--faults: expected a rate from 0 to 0.5, got {self.faults!r}")
        if not 1 <= self.max_tokens <= 256:
            raise ValueError(f"--max-tokens: expected 1 to 256, got {self.max_tokens!r}")
        self.workdir = Path(self.workdir)
        if self.prefills is None:
            self.prefills = 2 if self.faults > 0 else 1
        if (
            isinstance(self.prefills, bool)
            or not isinstance(self.prefills, int)
            or not 1 <= self.prefills <= 8
        ):
            raise ValueError(f"--prefills: expected 1 to 8, got {self.prefills!r}")
        if self.faults > 0 and self.prefills < 2:
            raise ValueError("--faults kills one P mid-run, so it needs --prefills 2 or more")


@dataclass
class Prompt:
    kind: str
    tokens: list[int]
    group: int  # prompts of one group are sent at once


@dataclass
class Outcome:
    prompt: Prompt
    verdict: str  # identical | mismatched | failed
    transfer_id: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str = ""
    tokens: list[int] = field(default_factory=list)


def make_prompts(count: int, seed: int) -> list[Prompt]:
    """A repeatable mix: shorter than a block, several blocks, a shared two-block prefix
    (a prefix-cache hit on D after its first use), and groups sent concurrently."""
    chance = random.Random(seed)
    prefix = [chance.randrange(3, VOCAB) for _ in range(2 * BLOCK)]
    prompts: list[Prompt] = []
    group = 0
    while len(prompts) < count:
        kind = ("short", "multi-block", "shared prefix", "concurrent")[group % 4]
        if kind == "concurrent":
            for _ in range(min(3, count - len(prompts))):
                prompts.append(
                    Prompt(
                        kind,
                        [chance.randrange(3, VOCAB) for _ in range(chance.randrange(150, 500))],
                        group,
                    )
                )
        else:
            if kind == "short":
                tokens = [chance.randrange(3, VOCAB) for _ in range(chance.randrange(5, BLOCK - 8))]
            elif kind == "multi-block":
                tokens = [
                    chance.randrange(3, VOCAB)
                    for _ in range(chance.randrange(2 * BLOCK, 5 * BLOCK))
                ]
            else:
                tokens = prefix + [
                    chance.randrange(3, VOCAB) for _ in range(chance.randrange(4, 60))
                ]
            prompts.append(Prompt(kind, tokens, group))
        group += 1
    return prompts


def connector_faults(rate: float, seed: int) -> dict[str, Any]:
    return {
        "fault_injection": {
            "fail_rate": rate / 4,
            "message_loss_rate": rate,
            "message_dup_rate": rate,
            "message_delay_rate": rate,
            "message_delay_s": 0.2,
            "seed": seed,
        },
        **FAULT_TIMEOUTS,
    }


# -- talking to servers -------------------------------------------------------------------------


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
    model: str, prompts: list[Prompt], options: DemoOptions, log
) -> list[list[int]]:
    """The single instance's greedy answers (the same server settings as P and D)."""
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
            async with httpx.AsyncClient(timeout=120) as client:
                return [
                    await _complete(client, server.url, model, p.tokens, options.max_tokens)
                    for p in prompts
                ]

        answers = asyncio.run(ask())
        log(f"single instance: {len(answers)} reference answers")
        return answers
    finally:
        server.stop()


async def _send_all(
    proxy_url: str,
    model: str,
    prompts: list[Prompt],
    expected: list[list[int]],
    options: DemoOptions,
    on_half,
) -> list[Outcome]:
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


# -- after the run --------------------------------------------------------------------------------


class Holding(TypedDict):
    """What a server holds after the run, read off its /metrics (``metrics``: the whole text)."""

    running: float
    waiting: float
    blocks_used: int
    metrics: str


def settle(servers: list[VllmServer], timeout_s: float) -> dict[str, Holding]:
    """Wait until no request is left and every KV block is back; what each server holds."""
    deadline = time.monotonic() + timeout_s
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
        time.sleep(0.5)


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


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def transfer_times(trace_files: list[Path]) -> tuple[list[float], Any]:
    """D's transfer lifetimes (first record to the last) from the traces, and the replay."""
    from ..trace.replay import replay

    report = replay([str(p) for p in trace_files])
    times = [
        s.last_t - s.created
        for s in report.transfers.values()
        if s.spec.name.endswith("_consumer") and s.last is not None
    ]
    return times, report


def draw_diagrams(mode: str, traces: list[Path], folder: Path) -> list[Path]:
    from .. import diagrams
    from ..machines import load_machine_spec

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (f"{mode}_producer", f"{mode}_consumer"):
        spec = load_machine_spec(name)
        usage = diagrams.usage_from_trace([str(p) for p in traces], spec)
        try:
            path = folder / f"{name}.svg"
            path.write_bytes(diagrams.render(spec, "svg", usage=usage))
        except diagrams.DiagramError:  # no graphviz binaries: mermaid needs none
            path = folder / f"{name}.mmd"
            path.write_bytes(diagrams.render(spec, "mermaid", usage=usage))
        written.append(path)
    return written


# -- the whole run ------------------------------------------------------------------------------


@dataclass
class DemoResult:
    outcomes: list[Outcome]
    leaked_blocks: int
    holdings: dict[str, Holding]
    transfer_s: list[float]
    replay_ok: bool
    anomalies: int
    killed: str | None
    traces: list[Path]
    diagrams: list[Path]

    def count(self, verdict: str) -> int:
        return sum(1 for o in self.outcomes if o.verdict == verdict)

    @property
    def line(self) -> str:
        return (
            f"requests={len(self.outcomes)} identical={self.count('identical')} "
            f"mismatched={self.count('mismatched')} failed={self.count('failed')} "
            f"leaked_blocks={self.leaked_blocks}"
        )

    @property
    def ok(self) -> bool:
        # Without faults every request must succeed; with them a clear failure is allowed.
        return (
            self.count("mismatched") == 0
            and self.leaked_blocks == 0
            and self.leftover_requests == 0
            and (self.count("failed") == 0 or self.faulty)
        )

    @property
    def leftover_requests(self) -> int:
        return int(sum(h["running"] + h["waiting"] for h in self.holdings.values()))

    faulty: bool = False
    model: str = ""
    expected: list[list[int]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # every server process group started


def run(
    options: DemoOptions,
    log=lambda text: print(text, file=sys.stderr),
    *,
    model: str | None = None,
    expected: list[list[int]] | None = None,
) -> DemoResult:
    """The whole demo; ``model`` and ``expected`` (the reference answers of the same
    prompts) may come from an earlier run, which then skips making them."""
    python = vllm_cpu_python()  # a ServerError naming the set-up script if missing
    options.workdir.mkdir(parents=True, exist_ok=True)
    (options.workdir / "logs").mkdir(exist_ok=True)
    if model is None:  # made where torch and transformers are: vLLM's venv
        model = str(make_tiny_llama_with(python, options.workdir / "tiny-llama", seed=options.seed))
    prompts = make_prompts(options.requests, options.seed)
    if expected is None:
        expected = reference_answers(model, prompts, options, log)
    elif len(expected) != len(prompts):
        raise ValueError(f"expected: {len(expected)} reference answers for {len(prompts)} prompts")
    extra = connector_faults(options.faults, options.seed) if options.faults else {}
    prefills = options.prefills
    assert prefills is not None, "DemoOptions chose it"
    deployment = PdDeployment(
        model,
        options.mode,
        options.workdir,
        prefills=prefills,
        connector_extra=extra,
        failure_policy=options.failure_policy,
    )
    killed: list[str] = []
    with deployment:
        log(f"P/D ({options.mode.upper()} mode): starting {prefills} P and 1 D with the connector")
        deployment.start(show_progress=options.show_progress)
        proxy = ProxyServer(
            deployment.proxy_config(request_timeout_s=120.0), free_ports(1)[0]
        ).start()
        log(
            f"proxy: {proxy.url} -> "
            + ", ".join(f"{m.name} {m.server.url}" for m in deployment.members)
        )

        def at_half() -> None:
            if options.faults and prefills >= 2:
                killed.append("P0")
                log("fault: killing P0 (SIGKILL) mid-run")
                deployment.kill("P0")

        try:
            outcomes = asyncio.run(_send_all(proxy.url, model, prompts, expected, options, at_half))
            alive = [m.server for m in deployment.alive()]
            settle_s = 3 * FAULT_TIMEOUTS["defer_timeout"] if options.faults else 20.0
            holdings = settle(alive, settle_s)
        finally:
            proxy.stop()
    leaked = int(sum(h["blocks_used"] for h in holdings.values()))
    traces = [
        m.trace_file for m in deployment.members if m.trace_file.exists() and m.name not in killed
    ]
    times, report = transfer_times(traces)
    pictures = draw_diagrams(options.mode, traces, options.workdir / "diagrams")
    return DemoResult(
        outcomes,
        leaked,
        holdings,
        times,
        report.ok,
        len(report.anomalies),
        killed[0] if killed else None,
        traces,
        pictures,
        faulty=options.faults > 0,
        model=model,
        expected=expected,
        pids=[m.server.pid for m in deployment.members],
    )


def render(result: DemoResult, options: DemoOptions) -> str:
    """The summary: a table of outcomes and timings, the connector's figures, where to look."""
    ok = [o for o in result.outcomes if o.verdict != "failed"]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    lines = [
        f"P/D demo, {options.mode.upper()} mode, {len(result.outcomes)} requests"
        + (
            f", faults at rate {options.faults}"
            + (f", {result.killed} killed mid-run" if result.killed else "")
            if options.faults
            else ""
        )
    ]
    kinds: dict[str, list[Outcome]] = {}
    for outcome in result.outcomes:
        kinds.setdefault(outcome.prompt.kind, []).append(outcome)
    lines.append(
        f"  {'prompts':<16}{'requests':>9}{'identical':>11}{'mismatched':>12}{'failed':>8}"
    )
    for kind, group in kinds.items():
        lines.append(
            f"  {kind:<16}{len(group):>9}{sum(o.verdict == 'identical' for o in group):>11}"
            f"{sum(o.verdict == 'mismatched' for o in group):>12}"
            f"{sum(o.verdict == 'failed' for o in group):>8}"
        )
    lines.append(
        f"  TTFT          p50 {_ms(_percentile(ttft, 0.5)):>10}   p99 {_ms(_percentile(ttft, 0.99)):>10}"
    )
    lines.append(
        f"  end-to-end    p50 {_ms(_percentile(e2e, 0.5)):>10}   p99 {_ms(_percentile(e2e, 0.99)):>10}"
    )
    lines.append(
        f"  transfer (D)  p50 {_ms(_percentile(result.transfer_s, 0.5)):>10}   "
        f"p99 {_ms(_percentile(result.transfer_s, 0.99)):>10}"
    )
    moved = 0.0
    states: dict[str, float] = {}
    outcomes: dict[str, float] = {}
    for name, held in result.holdings.items():
        text = held["metrics"]
        if name.startswith("P" if options.mode == "write" else "D"):
            moved += metric_value(text, "vllm:moriio_fsm_transfer_bytes_sum")
        for line in text.splitlines():
            if line.startswith("vllm:moriio_fsm_state_time_seconds_sum{"):
                state = line.split('state="', 1)[1].split('"', 1)[0]
                states[f"{name}:{state}"] = states.get(f"{name}:{state}", 0.0) + float(
                    line.rsplit(" ", 1)[1]
                )
            if line.startswith("vllm:moriio_fsm_transfers_total{"):
                ended = line.split('outcome="', 1)[1].split('"', 1)[0]
                outcomes[f"{name}:{ended}"] = float(line.rsplit(" ", 1)[1])
    lines.append(f"  KV bytes moved   {moved / (1 << 20):.1f} MiB")
    lines.append(
        "  transfers        " + ", ".join(f"{k}={v:.0f}" for k, v in sorted(outcomes.items()) if v)
    )
    busiest = sorted(states.items(), key=lambda kv: -kv[1])[:6]
    lines.append("  time per state   " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in busiest))
    lines.append(
        f"  traces replay    {'clean' if result.replay_ok else 'with findings'} "
        f"({result.anomalies} anomalies)"
    )
    if result.leftover_requests:
        lines.append(
            f"  LEFT ON THE SERVERS: {result.leftover_requests} requests still running or waiting"
        )
    failures = [o for o in result.outcomes if o.verdict == "failed"][:5]
    for outcome in failures:
        lines.append(f"  failed: {outcome.error[:200]}")
    for outcome in [o for o in result.outcomes if o.verdict == "mismatched"][:5]:
        lines.append(
            f"  MISMATCH {outcome.transfer_id}: {outcome.prompt.kind} prompt of "
            f"{len(outcome.prompt.tokens)} tokens"
        )
    trace_args = " ".join(str(p) for p in result.traces)
    lines.append(f"traces:   {trace_args}")
    lines.append(f"          moriio-fsm replay {trace_args}")
    example = next((o.transfer_id for o in failures if o.transfer_id), None) or next(
        (o.transfer_id for o in result.outcomes if o.transfer_id), None
    )
    if example:
        lines.append(f"          moriio-fsm explain {trace_args} --transfer {example}")
        lines.append(
            f"          moriio-fsm export-trace {trace_args} -o {options.workdir / 'trace.json'}"
            "   (opens in ui.perfetto.dev)"
        )
    lines.append("diagrams: " + " ".join(str(p) for p in result.diagrams))
    lines.append(f"logs:     {options.workdir / 'logs'}")
    lines.append(result.line)
    return "\n".join(lines)


__all__ = [
    "DemoError",
    "DemoOptions",
    "DemoResult",
    "ModelError",
    "ServerError",
    "make_prompts",
    "render",
    "run",
]
