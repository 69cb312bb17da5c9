"""The load benchmark's and the soak's pure parts: options, percentiles, goodput at an SLO,
sustained rates, the final ratios and the soak's memory arithmetic (no servers run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_load  # noqa: E402
import load_front  # noqa: E402
import load_stats as stats  # noqa: E402
import soak  # noqa: E402


def summary(rate: float, goodput: float, ttft_p99: float, ok: bool = True) -> stats.Summary:
    return stats.Summary(
        rate=rate,
        sent=10,
        completed=10 if ok else 9,
        ttft=(ttft_p99 / 2, ttft_p99),
        tpot=(0.01, 0.02),
        e2e=(0.2, 0.4),
        throughput=rate,
        goodput=goodput,
        arrival_rate=rate,
        sustained=ok,
    )


# -- options ---------------------------------------------------------------------------------


def test_slo_parses_each_bound_in_milliseconds():
    assert stats.parse_slo("ttft:500, tpot:50,e2el:2000") == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.0,
    }


@pytest.mark.parametrize(
    "text, named",
    [
        ("latency:5", "'latency:5'"),
        ("ttft", "'ttft'"),
        ("ttft:fast", "'fast'"),
        ("ttft:-1", "positive"),
        ("ttft:nan", "positive"),
        ("ttft:1,ttft:2", "twice"),
        ("", "at least one"),
    ],
)
def test_a_wrong_slo_is_refused_naming_the_part(text, named):
    with pytest.raises(ValueError, match="--slo") as caught:
        stats.parse_slo(text)
    assert named in str(caught.value)


def test_rates_come_sorted_and_wrong_ones_are_named():
    assert stats.parse_rates("8, 2,4") == [2.0, 4.0, 8.0]
    for text in ("2,x", "0", "-1", "inf", "2,2"):
        with pytest.raises(ValueError, match="--rates"):
            stats.parse_rates(text)


def test_bench_load_options_default_and_refusals(capsys):
    args = bench_load.parse_args([])
    assert args.rate_list == [2.0, 4.0, 6.0, 8.0]
    assert args.names == list(bench_load.CONNECTORS)
    for bad in (["--only", "single,vllm"], ["--rates", "0"], ["--requests", "0"], ["--slo", "x:1"]):
        with pytest.raises(SystemExit):
            bench_load.parse_args(bad)
    assert "--slo" in capsys.readouterr().err


def test_every_client_run_states_the_slo_and_asks_for_per_request_figures():
    args = bench_load.parse_args(["--slo", "ttft:300,e2el:900"])
    argv = bench_load.client_args(args, "/m", "http://h:1", 4.0, 10, 7, Path("/r/o.json"))
    goodput = argv.index("--goodput")
    assert argv[goodput + 1 : goodput + 3] == ["ttft:300", "e2el:900"]
    assert {"--save-detailed", "--ignore-eos"} <= set(argv)
    assert argv[argv.index("--request-rate") + 1] == "4"
    assert argv[argv.index("--ready-check-timeout-sec") + 1] == "0"  # no unmeasured extra request
    inf = bench_load.client_args(args, "/m", "u", float("inf"), 1, 1, Path("/r/o.json"))
    assert inf[inf.index("--request-rate") + 1] == "inf"


def test_soak_options_refuse_what_cannot_run():
    assert soak.parse_args(["--modes", "read"]).mode_list == ["read"]
    for bad in (
        ["--modes", "both"],
        ["--requests", "50", "--warmup", "50"],
        ["--faults", "0.9"],
        ["--concurrency", "0"],
    ):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


def test_the_peers_front_refuses_an_incomplete_spec():
    good = {"name": "m", "kind": "mooncake", "port": 1, "p": "u", "d": "v", "p_bootstrap": "b"}
    assert load_front.check_fronts([good]) == [good]
    with pytest.raises(ValueError, match="p_bootstrap"):
        load_front.check_fronts([{k: v for k, v in good.items() if k != "p_bootstrap"}])
    with pytest.raises(ValueError, match="kind"):
        load_front.check_fronts([dict(good, kind="ours")])
    with pytest.raises(ValueError, match="non-empty"):
        load_front.check_fronts([])


def test_the_peers_prefill_leg_asks_one_token_and_never_streams():
    body = {"prompt": "w3 w4", "max_tokens": 32, "stream": True, "stream_options": {"a": 1}}
    p_body = load_front.prefill_body(body, {"do_remote_decode": True})
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body
    assert body["max_tokens"] == 32  # the client's body is left as it was, for D


# -- arithmetic ------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks_as_numpy_does():
    values = [4.0, 1.0, 3.0, 2.0]
    assert stats.percentile(values, 50) == 2.5
    assert stats.percentile(values, 99) == pytest.approx(3.97)
    assert stats.percentile(values, 0) == 1.0 and stats.percentile(values, 100) == 4.0
    assert stats.percentile([], 50) != stats.percentile([], 50)  # NaN


def test_tpot_leaves_out_the_first_token_and_is_zero_for_one_token():
    assert stats.Request(True, ttft=0.1, e2e=0.4, output_tokens=4).tpot == pytest.approx(0.1)
    assert stats.Request(True, ttft=0.1, e2e=0.4, output_tokens=1).tpot == 0.0


def test_goodput_counts_only_successes_within_every_bound():
    slo = {"ttft": 200.0, "tpot": 50.0}
    good = stats.Request(True, ttft=0.2, e2e=0.2 + 3 * 0.049, output_tokens=4)
    slow_first = stats.Request(True, ttft=0.201, e2e=0.3, output_tokens=4)
    slow_tokens = stats.Request(True, ttft=0.1, e2e=0.1 + 3 * 0.051, output_tokens=4)
    failed = stats.Request(False)
    assert [stats.is_good(r, slo) for r in (good, slow_first, slow_tokens, failed)] == [
        True,
        False,
        False,
        False,
    ]
    s = stats.summarize(2.0, [good, slow_first, slow_tokens, failed], 2.0, [0, 0.5, 1.0, 1.5], slo)
    assert s.goodput == 0.5 and s.throughput == 1.5
    assert s.completed == 3 and s.failed == 1 and not s.sustained  # a failure: never sustained


def test_requests_are_read_from_a_detailed_result_and_a_plain_one_is_refused():
    result = {
        "errors": ["", "boom"],
        "ttfts": [0.1, 0.0],
        "latencies": [0.5, 0.0],
        "output_lens": [5, 0],
    }
    first, second = stats.requests_from_result(result)
    assert first == stats.Request(True, 0.1, 0.5, 5) and not second.ok
    with pytest.raises(ValueError, match="--save-detailed"):
        stats.requests_from_result({"completed": 2})


def test_a_rate_is_sustained_only_with_every_answer_and_no_growing_queue():
    # 10 sends over 2.5 s, a median answer of 0.5 s: 3 s without a queue.
    assert stats.sustained(10, 10, 3.3, 2.5, 0.5)
    assert not stats.sustained(10, 10, 3.4, 2.5, 0.5)  # the last answers lag: a backlog grew
    assert not stats.sustained(10, 9, 3.0, 2.5, 0.5)
    assert not stats.sustained(0, 0, 0.0, 0.0, float("nan"))
    assert stats.arrival_rate([0.0, 1.0, 2.0]) == 1.0
    one = stats.Request(True, 0.1, 0.2, 2)
    kept_up = stats.summarize(8.0, [one] * 3, 2.2, [0.0, 1.0, 2.0], {"ttft": 1e3})
    fell_behind = stats.summarize(8.0, [one] * 3, 2.5, [0.0, 1.0, 2.0], {"ttft": 1e3})
    assert kept_up.sustained and not fell_behind.sustained
    assert kept_up.arrival_rate == 1.0


def test_the_compared_rate_is_the_highest_every_connector_sustained():
    table = {
        "ours": {
            2.0: summary(2, 2, 0.1),
            4.0: summary(4, 4, 0.1),
            8.0: summary(8, 5, 0.1, ok=False),
        },
        "nixl": {2.0: summary(2, 2, 0.1), 4.0: summary(4, 4, 0.1), 8.0: summary(8, 8, 0.1)},
        "mooncake": {2.0: summary(2, 2, 0.1), 4.0: summary(4, 3, 0.1, ok=False)},
    }
    assert stats.highest_common_rate(table, ["ours", "nixl", "mooncake"]) == 2.0
    assert stats.highest_common_rate(table, ["ours", "nixl"]) == 4.0
    assert stats.highest_common_rate(table, ["nixl"]) == 8.0
    assert stats.highest_common_rate(table, ["ours", "absent"]) is None


def test_the_best_peer_is_chosen_per_figure():
    table = {"nixl": {4.0: summary(4, 3.0, 0.5)}, "mooncake": {4.0: summary(4, 3.5, 0.9)}}
    assert stats.best_peer(table, ["nixl", "mooncake"], 4.0) == ("mooncake", "nixl")
    assert stats.best_peer(table, ["nixl"], 2.0) == (None, None)


def test_ratios_say_when_there_is_nothing_to_divide_by():
    assert stats.ratio(3.0, 4.0) == 0.75
    assert stats.ratio(1.0, 0.0) == float("inf")
    nan = stats.ratio(0.0, 0.0)
    assert nan != nan


def test_the_report_ends_with_both_ratios_at_the_compared_rate(capsys):
    table = {
        "ours-write": {2.0: summary(2, 2.0, 0.2), 4.0: summary(4, 3.0, 0.3)},
        "ours-read": {2.0: summary(2, 2.0, 0.2), 4.0: summary(4, 3.0, 0.3)},
        "nixl": {2.0: summary(2, 2.0, 0.2), 4.0: summary(4, 4.0, 0.6)},
        "mooncake": {2.0: summary(2, 2.0, 0.2), 4.0: summary(4, 3.5, 0.4)},
    }
    results = {name: {rate: {} for rate in by} for name, by in table.items()}
    bench_load.report(table, results, [2.0, 4.0], {}, {"ttft": 500.0})
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "load_goodput_vs_best_peer: 0.750"  # 3.0 against nixl's 4.0
    assert lines[-1] == "load_ttft_p99_vs_best_peer: 0.750"  # 0.3 s against mooncake's 0.4 s
    assert any("sustains: 4 req/s" in line for line in lines)


def test_answers_are_compared_with_the_single_instance_ignoring_spacing_and_failures():
    single = {"generated_texts": ["w3 w4", "w5"], "errors": ["", ""]}
    pd = {"generated_texts": ["w3w4", "w6"], "errors": ["", ""]}
    assert bench_load.same_answers(pd, single) == "1/2"
    pd_failed = {"generated_texts": ["", "w5"], "errors": ["boom", ""]}
    assert bench_load.same_answers(pd_failed, single) == "1/1"


def test_rss_growth_is_over_the_processes_present_both_times():
    def kib(rss, anon, shmem):
        return {"VmRSS": rss, "RssAnon": anon, "RssShmem": shmem}

    before = {
        "P: EngineCore (pid 1)": kib(1000, 800, 200),
        "D: worker (pid 2)": kib(1000, 900, 100),
        "gone (pid 3)": kib(500, 500, 0),
    }
    after = {"P: EngineCore (pid 1)": kib(1100, 800, 300), "D: worker (pid 2)": kib(1000, 900, 100)}
    assert soak.rss_growth(before, after) == pytest.approx(0.05)
    assert soak.rss_growth(before, after, "RssAnon") == 0.0  # it was shared memory touched
    assert soak.total_mib(after) == pytest.approx(2100 / 1024)


def test_rss_parts_are_read_from_proc():
    import os

    parts = soak.rss_kib(os.getpid())
    assert set(parts) == set(soak.RSS_PARTS) and parts["VmRSS"] >= parts["RssAnon"] > 0
    assert soak.rss_kib(2**22 + 12345) == dict.fromkeys(soak.RSS_PARTS, 0)  # no such process
    assert soak.timeout_bound_s() == 20.0
