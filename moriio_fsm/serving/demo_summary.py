"""The demo's result and how it reads: verdict counts, the closing figures line, and the
summary table of outcomes, timings and the connector's own metrics.

The last line of the summary is always ``DemoResult.line``, which scripts may parse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .demo_holdings import Holding
from .demo_options import DemoOptions
from .demo_requests import Outcome
from .vllm_server import metric_value


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


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def render(result: DemoResult, options: DemoOptions) -> str:
    """The summary: a table of outcomes and timings, the connector's figures, where to look."""
    failures = [o for o in result.outcomes if o.verdict == "failed"][:5]
    lines = [_headline(result, options)]
    lines += _verdict_table(result.outcomes)
    lines += _timings(result)
    lines += _connector_figures(result, options)
    lines += _problems(result, failures)
    lines += _where_to_look(result, options, failures)
    lines.append(result.line)
    return "\n".join(lines)


def _headline(result: DemoResult, options: DemoOptions) -> str:
    faults = f", faults at rate {options.faults}" if options.faults else ""
    if result.killed:
        faults += f", {result.killed} killed mid-run"
    shape = f"{options.prefills} P + {options.decodes} D, "
    return f"P/D demo, {options.mode.upper()} mode, {shape}{len(result.outcomes)} requests" + faults


def _verdict_table(outcomes: list[Outcome]) -> list[str]:
    """One row per kind of prompt: how many requests, and how many of each verdict."""
    kinds: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        kinds.setdefault(outcome.prompt.kind, []).append(outcome)
    lines = [f"  {'prompts':<16}{'requests':>9}{'identical':>11}{'mismatched':>12}{'failed':>8}"]
    for kind, group in kinds.items():
        lines.append(
            f"  {kind:<16}{len(group):>9}{sum(o.verdict == 'identical' for o in group):>11}"
            f"{sum(o.verdict == 'mismatched' for o in group):>12}"
            f"{sum(o.verdict == 'failed' for o in group):>8}"
        )
    return lines


def _timings(result: DemoResult) -> list[str]:
    """Percentiles of the answered requests' TTFT and end-to-end times, and D's transfers."""
    ok = [o for o in result.outcomes if o.verdict != "failed"]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.e2e_s for o in ok if o.e2e_s is not None]
    return [
        f"  TTFT          p50 {_ms(_percentile(ttft, 0.5)):>10}   p99 {_ms(_percentile(ttft, 0.99)):>10}",
        f"  end-to-end    p50 {_ms(_percentile(e2e, 0.5)):>10}   p99 {_ms(_percentile(e2e, 0.99)):>10}",
        f"  transfer (D)  p50 {_ms(_percentile(result.transfer_s, 0.5)):>10}   "
        f"p99 {_ms(_percentile(result.transfer_s, 0.99)):>10}",
    ]


def _connector_figures(result: DemoResult, options: DemoOptions) -> list[str]:
    """The connector's own metrics: bytes moved (by the side that moves them), transfers
    by outcome, the six states most time was spent in, and the traces' replay."""
    moved = 0.0
    states: dict[str, float] = {}
    outcomes: dict[str, float] = {}
    for name, held in result.holdings.items():
        text = held["metrics"]
        if name.startswith("P" if options.mode == "write" else "D"):
            moved += metric_value(text, "vllm:moriio_fsm_transfer_bytes_sum")
        for line in text.splitlines():
            if line.startswith("vllm:moriio_fsm_state_time_seconds_sum{"):
                state = f"{name}:{_label(line, 'state')}"
                states[state] = states.get(state, 0.0) + float(line.rsplit(" ", 1)[1])
            if line.startswith("vllm:moriio_fsm_transfers_total{"):
                outcomes[f"{name}:{_label(line, 'outcome')}"] = float(line.rsplit(" ", 1)[1])
    busiest = sorted(states.items(), key=lambda kv: -kv[1])[:6]
    return [
        f"  KV bytes moved   {moved / (1 << 20):.1f} MiB",
        "  transfers        " + ", ".join(f"{k}={v:.0f}" for k, v in sorted(outcomes.items()) if v),
        "  time per state   " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in busiest),
        f"  traces replay    {'clean' if result.replay_ok else 'with findings'} "
        f"({result.anomalies} anomalies)",
    ]


def _label(metric_line: str, name: str) -> str:
    """The value of label ``name`` in one Prometheus sample line."""
    return metric_line.split(f'{name}="', 1)[1].split('"', 1)[0]


def _problems(result: DemoResult, failures: list[Outcome]) -> list[str]:
    """Requests left on the servers, the first failures and the first mismatches."""
    lines = []
    if result.leftover_requests:
        lines.append(
            f"  LEFT ON THE SERVERS: {result.leftover_requests} requests still running or waiting"
        )
    for outcome in failures:
        lines.append(f"  failed: {outcome.error[:200]}")
    for outcome in [o for o in result.outcomes if o.verdict == "mismatched"][:5]:
        lines.append(
            f"  MISMATCH {outcome.transfer_id}: {outcome.prompt.kind} prompt of "
            f"{len(outcome.prompt.tokens)} tokens"
        )
    return lines


def _where_to_look(result: DemoResult, options: DemoOptions, failures: list[Outcome]) -> list[str]:
    """The traces with the commands that read them (a failed transfer first), the
    diagrams and the logs."""
    trace_args = " ".join(str(p) for p in result.traces)
    lines = [f"traces:   {trace_args}", f"          moriio-fsm replay {trace_args}"]
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
    return lines


__all__ = ["DemoResult", "render"]
