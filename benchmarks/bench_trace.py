"""Benchmark: what tracing costs, and how fast a trace replays.

Measures, in one run: (a) a 64-layer WRITE producer lifecycle through a table with
tracing off and through one with the flight recorder on (``TraceRecorder`` with no
file), interleaved round by round so machine noise hits both alike; (b) a trace of at
least 1,000,000 steps (written by the background writer), replayed through fresh
machines against just parsing the same file with the trace reader. Prints medians and
ends with the three ratio lines.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

# The same 64-layer lifecycle bench_dispatch.py times (this folder is on sys.path when a
# benchmark runs as a script).
from bench_dispatch import NUM_LAYERS  # noqa: E402
from bench_dispatch import lifecycle_runtime as lifecycle

from moriio_fsm.machines import build_table
from moriio_fsm.trace import Step, TraceRecorder, iter_records
from moriio_fsm.trace.replay import replay

EVENTS_PER_LIFECYCLE = 2 * NUM_LAYERS + 5


def time_round(table, prefix: str, per_round: int) -> float:
    ids = [f"{prefix}-{i}" for i in range(per_round)]
    start = time.perf_counter()
    for i, tid in enumerate(ids):
        lifecycle(table, tid, float(i))
    return (time.perf_counter() - start) / per_round


def write_big_trace(path: Path, steps: int) -> int:
    """A trace of at least ``steps`` steps, written as a traced host writes one."""
    recorder = TraceRecorder("P0", file=path, max_bytes=1 << 40)
    table = build_table("write_producer", recorder=recorder)
    lifecycles = -(-steps // EVENTS_PER_LIFECYCLE)
    for i in range(lifecycles):
        lifecycle(table, f"tx-{i}", float(i))
        if i % 200 == 199:
            recorder.flush(timeout=600)  # keep the writer's queue within its bound
    recorder.close()
    stats = recorder.writer.stats()
    assert stats["dropped"] == 0 and stats["write_errors"] == 0, stats
    return stats["written"]


def parse_only(path: Path) -> int:
    count = 0
    for _, record in iter_records(path):
        if record.__class__ is Step:
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--replay-steps", type=int, default=1_000_000)
    parser.add_argument("--replay-rounds", type=int, default=3)
    args = parser.parse_args()

    plain = build_table("write_producer")
    traced = build_table("write_producer", recorder=TraceRecorder("bench"))
    samples: dict[str, list[float]] = {"off": [], "recorder": []}
    for r in range(args.rounds):
        samples["off"].append(time_round(plain, f"off{r}", args.per_round))
        samples["recorder"].append(time_round(traced, f"on{r}", args.per_round))
    off, on = (statistics.median(samples[k]) for k in ("off", "recorder"))
    print(
        f"tracing off      median {off * 1e6:9.1f} us per lifecycle ({EVENTS_PER_LIFECYCLE} events)"
    )
    print(
        f"flight recorder  median {on * 1e6:9.1f} us per lifecycle ({EVENTS_PER_LIFECYCLE} events)"
    )

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "big.jsonl"
        start = time.perf_counter()
        written = write_big_trace(path, args.replay_steps)
        print(
            f"trace written: {written:,} steps, {path.stat().st_size / 2**20:.0f} MiB in "
            f"{time.perf_counter() - start:.1f} s (background writer)"
        )
        replay_times, parse_times = [], []
        for _ in range(args.replay_rounds):
            start = time.perf_counter()
            parsed = parse_only(path)
            parse_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            report = replay([path])
            replay_times.append(time.perf_counter() - start)
            assert report.ok and report.compared == parsed == written, (
                report.compared,
                parsed,
                written,
                report.divergences[:1],
                report.anomalies[:1],
            )
        replay_s, parse_s = statistics.median(replay_times), statistics.median(parse_times)
    print(f"replay           median {replay_s:9.2f} s for {written:,} steps")
    print(f"parse only       median {parse_s:9.2f} s for {written:,} steps")
    print(f"recorder_overhead: {on / off:.2f}")
    print(f"replay_events_per_s: {int(written / replay_s)}")
    print(f"replay_vs_parse: {replay_s / parse_s:.2f}")


if __name__ == "__main__":
    main()
