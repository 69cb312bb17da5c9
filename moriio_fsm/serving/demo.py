"""``moriio-fsm demo``: real P/D serving of a tiny Llama, checked token by token against one instance.

The whole run: make the model, get the single instance's answers, serve the same prompts
through P + D + the proxy, let the servers settle, replay the traces and draw the machines.
Under ``--faults`` one P is killed mid-run: every request must then match or fail with a
clear error, and no block may be left behind. Its parts: demo_options.py (what is asked),
demo_requests.py (sending it), demo_holdings.py (what is left behind), demo_summary.py
(the result and its summary).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from .backends import BackendUnavailable, require_backend
from .demo_holdings import DemoError, Holding, settle
from .demo_options import FAULT_TIMEOUTS, DemoOptions, Prompt, connector_faults, make_prompts
from .demo_requests import Outcome, reference_answers, send_all
from .demo_summary import DemoResult, render
from .launcher import PdDeployment, free_ports
from .proxy_app import ProxyServer
from .tiny_model import ModelError, make_tiny_llama_with
from .vllm_server import ServerError, vllm_cpu_python


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
    require_backend(options.backend, python)  # BackendUnavailable says why, before start-up
    options.workdir.mkdir(parents=True, exist_ok=True)
    (options.workdir / "logs").mkdir(exist_ok=True)
    if model is None:  # made where torch and transformers are: vLLM's venv
        model = str(make_tiny_llama_with(python, options.workdir / "tiny-llama", seed=options.seed))
    prompts = make_prompts(options.requests, options.seed)
    if expected is None:
        expected = reference_answers(model, prompts, options, log)
    elif len(expected) != len(prompts):
        raise ValueError(f"expected: {len(expected)} reference answers for {len(prompts)} prompts")
    extra = connector_faults(options.faults, options.seed) if options.disrupted else {}
    assert options.prefills is not None, "DemoOptions chose it"
    deployment = PdDeployment(
        model,
        options.mode,
        options.workdir,
        prefills=options.prefills,
        decodes=options.decodes,
        connector_extra=extra,
        failure_policy=options.failure_policy,
        backend=options.backend,
    )
    outcomes, holdings, killed = _serve(deployment, model, prompts, expected, options, log)
    traces = [
        m.trace_file for m in deployment.members if m.trace_file.exists() and m.name != killed
    ]
    times, report = transfer_times(traces)
    pictures = draw_diagrams(options.mode, traces, options.workdir / "diagrams")
    return DemoResult(
        outcomes,
        int(sum(h["blocks_used"] for h in holdings.values())),
        holdings,
        times,
        report.ok,
        len(report.anomalies),
        killed,
        traces,
        pictures,
        faulty=options.disrupted,
        model=model,
        expected=expected,
        pids=[m.server.pid for m in deployment.members],
    )


def _serve(
    deployment: PdDeployment,
    model: str,
    prompts: list[Prompt],
    expected: list[list[int]],
    options: DemoOptions,
    log,
) -> tuple[list[Outcome], dict[str, Holding], str | None]:
    """Start P, D and the proxy, send every prompt, wait until the servers settle; stop all.
    Returns the outcomes, what each live server holds, and the instance killed mid-run (if any)."""
    killed: list[str] = []
    with deployment:
        log(
            f"P/D ({options.mode.upper()} mode): starting {options.prefills} P and "
            f"{options.decodes} D with the connector"
        )
        deployment.start(show_progress=options.show_progress)
        proxy = ProxyServer(
            deployment.proxy_config(request_timeout_s=120.0), free_ports(1)[0]
        ).start()
        log(
            f"proxy: {proxy.url} -> "
            + ", ".join(f"{m.name} {m.server.url}" for m in deployment.members)
        )

        def at_half() -> None:
            if options.kill is not None:
                killed.append(options.kill)
                log(f"fault: killing {options.kill} (SIGKILL) mid-run")
                deployment.kill(options.kill)

        try:
            outcomes = asyncio.run(send_all(proxy.url, model, prompts, expected, options, at_half))
            alive = [m.server for m in deployment.alive()]
            settle_s = 3 * FAULT_TIMEOUTS["defer_timeout"] if options.disrupted else 20.0
            holdings = settle(alive, settle_s)
        finally:
            proxy.stop()
    return outcomes, holdings, killed[0] if killed else None


__all__ = [
    "BackendUnavailable",
    "DemoError",
    "DemoOptions",
    "DemoResult",
    "ModelError",
    "ServerError",
    "make_prompts",
    "render",
    "run",
]
