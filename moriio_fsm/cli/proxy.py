"""``moriio-fsm proxy``: the P/D proxy in front of running P and D vLLM servers.

An OpenAI-compatible /v1/completions (streaming or not) that sends each request's prefill
to a P and its decode to a D, round robin, skipping instances that are down. Exit 0 after
a clean stop (Ctrl-C); 2 when an instance spec or option is wrong (the message names it).
"""

from __future__ import annotations

import argparse
import sys

from ._command import add_command


def _proxy(args: argparse.Namespace) -> int:
    from ..serving.instances import Instance, ProxyConfig, ProxyConfigError
    from ..serving.proxy_app import uvicorn_server

    try:
        config = ProxyConfig(
            args.mode,
            [Instance.parse(f"P{i}", s) for i, s in enumerate(args.prefill)],
            [Instance.parse(f"D{i}", s) for i, s in enumerate(args.decode)],
            **proxy_settings(args),
        )
    except ProxyConfigError as exc:
        print(f"moriio-fsm proxy: {exc}", file=sys.stderr)
        return 2
    print(
        f"moriio-fsm proxy: {args.mode.upper()} mode on http://{args.host}:{args.port} "
        f"({len(config.prefills)} P, {len(config.decodes)} D)",
        file=sys.stderr,
    )
    uvicorn_server(config, args.host, args.port).run()
    return 0


def proxy_settings(args: argparse.Namespace) -> dict:
    """The ``ProxyConfig`` settings the options below give."""
    return {
        "request_timeout_s": args.timeout,
        "max_connections": args.max_connections,
        "header_timeout_s": args.header_timeout,
        "body_timeout_s": args.body_timeout,
        "first_token_from_prefill": not args.no_first_token_from_prefill,
        "otel": args.otel,
    }


def add_proxy_options(
    p: argparse.ArgumentParser,
    port_help: str = "the proxy's port",
    host_help: str = "the proxy's address",
) -> None:
    p.add_argument("--port", type=int, default=8000, help=f"{port_help} (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help=f"{host_help} (default 127.0.0.1)")
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="longest wait for an instance's answer, seconds (default 120)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=256,
        metavar="N",
        help="client connections open at once; one more is answered 503 and closed (default 256)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a request's head (request line and headers) must arrive within S "
        "seconds of the connection's opening or last answer, else the "
        "connection is closed (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a request's whole body must arrive within S seconds of its head, "
        "else it is answered 408 and the connection closed (default 30)",
    )
    p.add_argument(
        "--no-first-token-from-prefill",
        action="store_true",
        help="READ mode: the client waits for D's first token; by default P's first token "
        "goes to the client at once and D continues after it",
    )
    p.add_argument(
        "--otel",
        action="store_true",
        help="a span per request, exported over OTLP to OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
        "(needs the otel extra); the client's traceparent reaches P and D either way",
    )


def register(sub) -> None:
    p = add_command(sub, "proxy", __doc__)
    p.add_argument(
        "--mode", choices=("write", "read"), required=True, help="the connector's mode on P and D"
    )
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL[,kv=HOST:NOTIFY:HANDSHAKE][,tp=N]",
        help="a P instance (repeat for more); WRITE mode needs where its connector listens, "
        "and tp=N when its tensor-parallel size differs from D's",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL[,kv=HOST:NOTIFY:HANDSHAKE][,tp=N]",
        help="a D instance (repeat for more)",
    )
    add_proxy_options(p)
    p.set_defaults(run=_proxy)
