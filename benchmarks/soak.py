"""The soak: thousands of requests, many at once, through the proxy to a P and a D with this
connector under injected faults, in WRITE and READ mode; checks every answer and what is left.

Per mode: one P and one D vLLM server (the demo's tiny Llama and settings, one core each) and
the project's proxy as its own process (``moriio-fsm proxy``); the demo's prompt mix, sent by
``--concurrency`` clients at once; the connector fails RDMA operations and loses, duplicates and
delays control messages at ``--faults`` (the demo's fault settings and short timeouts). Prints
``mismatched=0 leaked_blocks=0`` style totals, the slowest request against the longest chain of
timeouts a request can meet, and the resident memory (RSS) of every process of P, D (API
server, EngineCore, worker, their helpers) and the proxy after the warm-up and after the run.

Run (the vLLM CPU venv has vllm and moriio-fsm):

    .venv-vllm-cpu/bin/python benchmarks/soak.py                          # both modes
    .venv-vllm-cpu/bin/python benchmarks/soak.py --requests 2000 --faults 0.05 --modes write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moriio_fsm.serving.demo_holdings import settle  # noqa: E402
from moriio_fsm.serving.demo_options import (  # noqa: E402
    FAULT_TIMEOUTS,
    DemoOptions,
    connector_faults,
    make_prompts,
)
from moriio_fsm.serving.demo_requests import reference_answers  # noqa: E402
from moriio_fsm.serving.launcher import PdDeployment, free_ports  # noqa: E402
from moriio_fsm.serving.tiny_model import make_tiny_llama_with  # noqa: E402
from moriio_fsm.serving.vllm_server import vllm_cpu_python  # noqa: E402

#: The longest chain of the connector's timeouts one request can meet under faults: P's
#: transfer timeout, then D's wait for a verdict, then D's abort of a receive. A request slower
#: than this waited for something no timeout covers.
TIMEOUT_CHAIN = ("transfer_timeout", "defer_timeout", "recv_abort_timeout")
#: Memory after the run may exceed memory after warm-up by this fraction (goal).
RSS_GOAL = 0.10
PROXY_TIMEOUT_S = 60.0


@dataclass
class Result:
    """One request: ``verdict`` identical, mismatched or failed."""

    verdict: str
    e2e: float
    error: str = ""


@dataclass
class ModeReport:
    mode: str
    results: list[Result] = field(default_factory=list)
    leaked_blocks: int = 0
    rss_warm: dict[str, dict[str, int]] = field(default_factory=dict)
    rss_end: dict[str, dict[str, int]] = field(default_factory=dict)
    wall_s: float = 0.0


def timeout_bound_s() -> float:
    return float(sum(FAULT_TIMEOUTS[key] for key in TIMEOUT_CHAIN))


# -- memory --------------------------------------------------------------------------------


def group_pids(leader: int) -> list[int]:
    """Every live process of the process group ``leader`` leads (a server and its engine)."""
    done = subprocess.run(["pgrep", "-g", str(leader)], capture_output=True, text=True)
    return sorted({leader, *(int(p) for p in done.stdout.split())})


def process_label(pid: int) -> str:
    """A process's role from its title: vLLM names its EngineCore and worker processes."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "gone"
    for needle, label in (
        ("EngineCore", "EngineCore"),
        ("Worker", "worker"),
        ("resource_tracker", "resource tracker"),
        ("api_server", "API server"),
        ("moriio_fsm.cli", "proxy"),
    ):
        if needle in title:
            return label
    return title.split(" ")[0].rsplit("/", 1)[-1] or "?"


#: The parts of a process's resident memory (/proc/PID/status, KiB): all of it, its private
#: memory, and the shared memory it touched (the KV caches one side maps of the other's).
RSS_PARTS = ("VmRSS", "RssAnon", "RssShmem")


def rss_kib(pid: int) -> dict[str, int]:
    parts = dict.fromkeys(RSS_PARTS, 0)
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in parts:
                parts[name] = int(value.split()[0])
    except OSError:
        pass
    return parts


def sample_rss(groups: dict[str, int]) -> dict[str, dict[str, int]]:
    """``{"P: EngineCore (pid 12)": {"VmRSS": KiB, ...}, ...}`` for every process of every group."""
    out = {}
    for name, leader in groups.items():
        for pid in group_pids(leader):
            out[f"{name}: {process_label(pid)} (pid {pid})"] = rss_kib(pid)
    return out


def rss_growth(before: dict, after: dict, part: str = "VmRSS") -> float:
    """Total growth of ``part`` as a fraction of its total before (processes at both samples)."""
    common = [key for key in before if key in after]
    total = sum(before[key][part] for key in common)
    grown = sum(after[key][part] for key in common) - total
    return grown / total if total else float("nan")


def print_single_baseline(single: dict) -> None:
    """What the same prompts, one at a time, did to a single instance's memory: the baseline
    for P's and D's growth (vLLM and torch grow with the shapes they meet)."""
    if "warm" not in single or "end" not in single:
        return
    for key, before in single["warm"].items():
        after = single["end"].get(key)
        if after and before["VmRSS"]:
            private = (after["RssAnon"] - before["RssAnon"]) / 1024
            change = (after["VmRSS"] - before["VmRSS"]) / before["VmRSS"]
            print(
                f"  baseline {key}: {before['VmRSS'] / 1024:.1f} MiB after the warm-up's "
                f"prompts, {after['VmRSS'] / 1024:.1f} MiB after all ({change * 100:+.1f}%, "
                f"private {private:+.1f} MiB)"
            )


def total_mib(sample: dict) -> float:
    return sum(parts["VmRSS"] for parts in sample.values()) / 1024


def print_rss(report) -> None:
    """Each process's RSS after warm-up and after the run, with how much of the change is
    private memory and how much shared memory it touched."""
    print(
        f"  {'process':<44} {'after warm-up':>14} {'after run':>11} {'change':>8} "
        f"{'private':>9} {'shared':>9}"
    )
    for key, before in report.rss_warm.items():
        after = report.rss_end.get(key)
        if not after or not before["VmRSS"]:
            print(f"  {key:<44} {before['VmRSS'] / 1024:>10.1f} MiB {'-':>11} {'gone':>8}")
            continue
        change = (after["VmRSS"] - before["VmRSS"]) / before["VmRSS"]
        private = (after["RssAnon"] - before["RssAnon"]) / 1024
        shared = (after["RssShmem"] - before["RssShmem"]) / 1024
        print(
            f"  {key:<44} {before['VmRSS'] / 1024:>10.1f} MiB {after['VmRSS'] / 1024:>7.1f} MiB "
            f"{change * 100:>+7.1f}% {private:>+6.1f}MiB {shared:>+6.1f}MiB"
        )


# -- requests --------------------------------------------------------------------------------


async def one_request(client, url: str, model: str, tokens: list[int], max_tokens: int, expected):
    import httpx

    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "stream": True,
    }
    started = time.monotonic()
    out: list[int] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                return Result(
                    "failed", time.monotonic() - started, f"HTTP {reply.status_code}: {text[:200]}"
                )
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result("failed", time.monotonic() - started, str(event["error"])[:200])
                for choice in event.get("choices", ()):
                    out.extend(choice.get("token_ids") or [])
    except httpx.HTTPError as exc:
        return Result("failed", time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    verdict = "identical" if out == expected else "mismatched"
    return Result(verdict, time.monotonic() - started)


async def send(url: str, model: str, jobs, concurrency: int, max_tokens: int) -> list[Result]:
    """Every (tokens, expected) job, ``concurrency`` at a time; results in the jobs' order."""
    import httpx

    results: list[Result | None] = [None] * len(jobs)
    queue = iter(enumerate(jobs))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(180.0, connect=5.0), limits=limits
    ) as client:

        async def worker() -> None:
            for index, (tokens, expected) in queue:
                results[index] = await one_request(client, url, model, tokens, max_tokens, expected)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [r for r in results if r is not None]


# -- one mode --------------------------------------------------------------------------------


def start_proxy(python: str, deployment: PdDeployment, work: Path) -> tuple[subprocess.Popen, str]:
    (port,) = free_ports(1)

    def spec(member) -> str:
        return f"{member.server.url},kv=127.0.0.1:{member.notify_port}:{member.handshake_port}"

    command = [
        python,
        "-m",
        "moriio_fsm.cli",
        "proxy",
        "--mode",
        deployment.mode,
        "--port",
        str(port),
    ]
    command += ["--timeout", f"{PROXY_TIMEOUT_S:g}"]
    for member in deployment.members:
        command += ["--prefill" if member.role == "prefill" else "--decode", spec(member)]
    log = open(work / "logs" / f"proxy-{deployment.mode}.log", "wb")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(200):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return process, url
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the proxy did not come up; see {work / 'logs'}")


def run_mode(args, mode: str, model: str, jobs, python: str) -> ModeReport:
    work = Path(args.work) / mode
    extra = connector_faults(args.faults, args.seed) if args.faults else {}
    report = ModeReport(mode)
    with PdDeployment(model, mode, work, prefills=1, connector_extra=extra) as deployment:
        deployment.start(show_progress=False)
        proxy, url = start_proxy(python, deployment, work)
        try:
            groups = {m.name: m.server.pid for m in deployment.members} | {"proxy": proxy.pid}
            servers = [m.server for m in deployment.members]
            started = time.monotonic()
            warm = asyncio.run(
                send(url, model, jobs[: args.warmup], args.concurrency, args.max_tokens)
            )
            settle(servers, 3 * FAULT_TIMEOUTS["defer_timeout"])
            report.rss_warm = sample_rss(groups)
            print(f"  {mode}: warm-up done ({len(warm)} requests); RSS sampled", flush=True)
            rest = asyncio.run(
                send(url, model, jobs[args.warmup :], args.concurrency, args.max_tokens)
            )
            holdings = settle(servers, 3 * FAULT_TIMEOUTS["defer_timeout"])
            report.wall_s = time.monotonic() - started
            report.rss_end = sample_rss(groups)
            report.results = warm + rest
            report.leaked_blocks = int(sum(h["blocks_used"] for h in holdings.values()))
        finally:
            proxy.terminate()
            try:
                proxy.wait(10)
            except subprocess.TimeoutExpired:
                proxy.kill()
                proxy.wait()
    return report


# -- report ----------------------------------------------------------------------------------


def print_mode(report: ModeReport, bound: float) -> bool:
    counts = {
        v: sum(r.verdict == v for r in report.results)
        for v in ("identical", "mismatched", "failed")
    }
    slowest = max((r.e2e for r in report.results), default=0.0)
    late = sum(r.e2e > bound for r in report.results)
    growth = rss_growth(report.rss_warm, report.rss_end)
    print(f"{report.mode.upper()} mode: {len(report.results)} requests in {report.wall_s:.0f}s")
    print_rss(report)
    private = rss_growth(report.rss_warm, report.rss_end, "RssAnon")
    print(
        f"  RSS total {total_mib(report.rss_warm):.1f} MiB after warm-up, "
        f"{total_mib(report.rss_end):.1f} MiB after the run: {growth * 100:+.1f}% "
        f"(goal within {RSS_GOAL * 100:.0f}%); private memory (RssAnon) {private * 100:+.1f}%"
    )
    print(f"  slowest request {slowest:.2f}s; past the timeouts' chain ({bound:g}s): {late}")
    errors = sorted({r.error for r in report.results if r.verdict == "failed"})
    for error in errors[:3]:
        print(f"  a failure: {error}")
    print(
        f"  requests={len(report.results)} identical={counts['identical']} "
        f"mismatched={counts['mismatched']} failed={counts['failed']} "
        f"leaked_blocks={report.leaked_blocks} past_timeouts={late} rss_growth={growth * 100:+.1f}%"
    )
    return counts["mismatched"] == 0 and report.leaked_blocks == 0 and late == 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="write,read", help="write, read or both (default)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per mode (2000)")
    parser.add_argument("--warmup", type=int, default=100, help="of those, warm-up first (100)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once (8)")
    parser.add_argument("--faults", type=float, default=0.05, help="fault rate (0.05; 0: none)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens (16)")
    parser.add_argument("--seed", type=int, default=0, help="prompts' and faults' seed (0)")
    parser.add_argument("--work", default="/tmp/moriio-soak", help="model, logs, traces")
    args = parser.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list or any(m not in ("write", "read") for m in args.mode_list):
        parser.error(f"--modes: expected write, read or write,read, got {args.modes!r}")
    if not 1 <= args.requests <= 10_000:
        parser.error(f"--requests: expected 1 to 10000, got {args.requests}")
    if not 0 <= args.warmup < args.requests:
        parser.error(f"--warmup: expected 0 to {args.requests - 1}, got {args.warmup}")
    if not 1 <= args.concurrency <= 256:
        parser.error(f"--concurrency: expected 1 to 256, got {args.concurrency}")
    if not 0.0 <= args.faults <= 0.5:
        parser.error(f"--faults: expected a rate from 0 to 0.5, got {args.faults}")
    if not 1 <= args.max_tokens <= 256:
        parser.error(f"--max-tokens: expected 1 to 256, got {args.max_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    python = vllm_cpu_python()
    model = str(make_tiny_llama_with(python, work / "tiny-llama", seed=args.seed))
    prompts = make_prompts(args.requests, args.seed)
    options = DemoOptions(requests=args.requests, workdir=work, max_tokens=args.max_tokens)
    started = time.monotonic()
    single: dict[str, dict] = {}

    def sample_single(index: int, server) -> None:
        """The single instance's memory after as many answers as the warm-up, and at the end."""
        if index in (args.warmup - 1, len(prompts) - 1):
            single["warm" if index == args.warmup - 1 else "end"] = sample_rss(
                {"single": server.pid}
            )

    expected = reference_answers(
        model, prompts, options, lambda text: print(text, flush=True), sample_single
    )
    print(f"reference answers: {len(expected)} in {time.monotonic() - started:.0f}s", flush=True)
    print_single_baseline(single)
    jobs = [(p.tokens, e) for p, e in zip(prompts, expected)]
    bound = timeout_bound_s()
    print(
        f"soak: {args.requests} requests per mode ({args.warmup} warm-up), {args.concurrency} at once, "
        f"faults {args.faults:g} (RDMA failures {args.faults / 4:g}, message loss/dup/delay {args.faults:g}), "
        f"{args.max_tokens} greedy tokens, 1 P + 1 D + the proxy ({os.cpu_count()} cores)"
    )
    print(
        f"timeouts' chain: {' + '.join(f'{k} {FAULT_TIMEOUTS[k]:g}s' for k in TIMEOUT_CHAIN)} = {bound:g}s"
    )
    ok = True
    for mode in args.mode_list:
        report = run_mode(args, mode, model, jobs, python)
        ok = print_mode(report, bound) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
