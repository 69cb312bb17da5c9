"""The load benchmark's arithmetic: per-request figures from a ``vllm bench serve`` result,
percentiles, goodput at a stated SLO, whether a rate was sustained, and the final ratios.

Pure functions over numbers (no servers, no vLLM), so the suite can test them. Rules: a
percentile interpolates linearly between ranks (as numpy and ``vllm bench serve`` do); a
request is good when it succeeded and meets every SLO bound; TPOT of a one-token answer is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: SLO keys, as ``vllm bench serve --goodput`` names them, and what each bounds.
SLO_KEYS = {"ttft": "time to first token", "tpot": "time per output token", "e2el": "end-to-end"}
#: A rate is sustained when every request succeeded and the run took at most 1/this of what it
#: takes without a queue (the sends' span plus one median answer): a growing backlog makes the
#: last answers come ever later than their sends.
SUSTAIN_FRACTION = 0.9


@dataclass(frozen=True)
class Request:
    """One request's outcome, in seconds; ``ok`` False for a failed one (its times unused)."""

    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for an answer of one token)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Summary:
    """One connector at one offered rate."""

    rate: float
    sent: int
    completed: int
    ttft: tuple[float, float]  # p50, p99 (seconds)
    tpot: tuple[float, float]
    e2e: tuple[float, float]
    throughput: float  # completed requests per second
    goodput: float  # good requests per second
    arrival_rate: float  # the rate requests were actually sent at
    sustained: bool

    @property
    def failed(self) -> int:
        return self.sent - self.completed


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft:500,tpot:50"`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds).

    A ``ValueError`` names the part that is wrong and what was expected."""
    slo: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"--slo: {part!r} must be KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}"
            )
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(
                f"--slo: {part!r}: {value!r} is not a number of milliseconds"
            ) from None
        if not math.isfinite(bound) or bound <= 0:
            raise ValueError(
                f"--slo: {part!r}: the bound must be a positive number of milliseconds"
            )
        if key in slo:
            raise ValueError(f"--slo: {key} is given twice")
        slo[key] = bound
    if not slo:
        raise ValueError("--slo: give at least one bound, e.g. ttft:500,tpot:50")
    return slo


def describe_slo(slo: dict[str, float]) -> str:
    return " and ".join(f"{SLO_KEYS[key]} ({key}) <= {bound:g} ms" for key, bound in slo.items())


def parse_rates(text: str) -> list[float]:
    """``"2,4,8"`` -> ``[2.0, 4.0, 8.0]``: positive, finite, distinct, sorted ascending."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is not a number of requests per second") from None
        if not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"--rates: {part!r} must be a positive, finite request rate")
        rates.append(rate)
    if len(set(rates)) != len(rates):
        raise ValueError(f"--rates: {text!r} names a rate twice")
    return sorted(rates)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile, linear between ranks; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def is_good(request: Request, slo: dict[str, float]) -> bool:
    """Succeeded, and within every bound of ``slo`` (milliseconds)."""
    if not request.ok:
        return False
    measured = {"ttft": request.ttft, "tpot": request.tpot, "e2el": request.e2e}
    return all(measured[key] * 1e3 <= bound for key, bound in slo.items())


def requests_from_result(result: dict) -> list[Request]:
    """The per-request outcomes of a ``vllm bench serve --save-result --save-detailed`` file."""
    errors = result.get("errors")
    if errors is None:
        raise ValueError("the result has no per-request 'errors': run with --save-detailed")
    out = []
    for index, error in enumerate(errors):
        if error:
            out.append(Request(ok=False))
            continue
        out.append(
            Request(
                ok=True,
                ttft=float(result["ttfts"][index]),
                e2e=float(result["latencies"][index]),
                output_tokens=int(result["output_lens"][index]),
            )
        )
    return out


def arrival_rate(start_times: list[float]) -> float:
    """Requests per second at which these were sent (first to last send); inf for one."""
    if len(start_times) < 2:
        return float("inf")
    span = max(start_times) - min(start_times)
    return (len(start_times) - 1) / span if span > 0 else float("inf")


def summarize(
    rate: float,
    requests: list[Request],
    duration_s: float,
    start_times: list[float],
    slo: dict[str, float],
) -> Summary:
    """One run's figures; throughput and goodput over ``duration_s`` (first send to last answer)."""
    done = [r for r in requests if r.ok]
    good = sum(1 for r in requests if is_good(r, slo))
    throughput = len(done) / duration_s if duration_s > 0 else 0.0
    sent_at = arrival_rate(start_times)

    def p50_p99(values: list[float]) -> tuple[float, float]:
        return percentile(values, 50), percentile(values, 99)

    return Summary(
        rate=rate,
        sent=len(requests),
        completed=len(done),
        ttft=p50_p99([r.ttft for r in done]),
        tpot=p50_p99([r.tpot for r in done if r.output_tokens > 1]),
        e2e=p50_p99([r.e2e for r in done]),
        throughput=throughput,
        goodput=good / duration_s if duration_s > 0 else 0.0,
        arrival_rate=sent_at,
        sustained=sustained(
            len(requests),
            len(done),
            duration_s,
            send_span(start_times),
            percentile([r.e2e for r in done], 50),
        ),
    )


def send_span(start_times: list[float]) -> float:
    """Seconds from the first send to the last."""
    return max(start_times) - min(start_times) if start_times else 0.0


def sustained(sent: int, completed: int, duration_s: float, span_s: float, e2e_p50: float) -> bool:
    """Every request answered, and the run no longer than ``(span_s + e2e_p50) / SUSTAIN_FRACTION``:
    without a queue the last answer comes about one answer's time after the last send."""
    if sent == 0 or completed != sent or e2e_p50 != e2e_p50:
        return False
    return duration_s * SUSTAIN_FRACTION <= span_s + e2e_p50


def highest_common_rate(table: dict[str, dict[float, Summary]], names: list[str]) -> float | None:
    """The highest rate that each of ``names`` sustained (every one measured there); None if none."""
    rates = sorted({rate for name in names for rate in table.get(name, {})}, reverse=True)
    for rate in rates:
        if all(
            name in table and rate in table[name] and table[name][rate].sustained for name in names
        ):
            return rate
    return None


def best_peer(
    table: dict[str, dict[float, Summary]], peers: list[str], rate: float
) -> tuple[str | None, str | None]:
    """(the peer with the most goodput at ``rate``, the one with the lowest TTFT p99 there)."""
    there = {name: table[name][rate] for name in peers if rate in table.get(name, {})}
    if not there:
        return None, None
    by_goodput = max(there, key=lambda name: there[name].goodput)
    by_ttft = min(there, key=lambda name: there[name].ttft[1])
    return by_goodput, by_ttft


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``: inf when only theirs is 0, NaN when both are or either is unknown."""
    if math.isnan(theirs) or math.isnan(ours):
        return float("nan")
    if theirs == 0:
        return float("inf") if ours > 0 else float("nan")
    return ours / theirs
