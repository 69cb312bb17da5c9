"""The transfer backend a deployment's servers use: its name, checked, and whether it runs there.

Rules: a name outside ``BACKENDS`` is a ``ValueError`` naming the choices; whether a backend
runs is asked of the vLLM servers' own python, in a child process, before minutes of
start-up, and a backend that cannot run is a ``BackendUnavailable`` that says why and what
to use instead. The check reuses the engines' own probes, so it follows them.
"""

from __future__ import annotations

import subprocess

from ..errors import MoriioFsmError

#: same_host: one host, cross-memory copies; nixl: NIXL over UCX (TCP between hosts);
#: rdma: AMD's mori.io over RDMA NICs.
BACKENDS = ("same_host", "nixl", "rdma")

#: The probe each backend's engine makes before it starts, run in the servers' python.
_PROBES = {
    "nixl": "from moriio_fsm.engines.nixl import probe_nixl as probe",
    "rdma": "from moriio_fsm.engines.mori import mori_availability as probe",
}

_INSTEAD = {
    "nixl": "install it with `pip install nixl==1.5.1` in that python "
    "(scripts/setup-vllm-cpu.sh does), or use --backend same_host with P and D on one host",
    "rdma": "rdma needs AMD's mori.io (the `mori` extra: amd-mori 1.2.4, with ROCm) and an "
    "RDMA device; to try it without them, MORIIO_FSM_MORI=standin runs mori's own Python "
    "layer over the project's stand-in (host memory over TCP); between hosts without them "
    "use --backend nixl, on one host same_host",
}


class BackendUnavailable(MoriioFsmError, RuntimeError):
    """The chosen backend cannot run in the servers' python; the message says why."""


def check_backend(name: object) -> str:
    """``name`` if it is a backend the servers can be given, else a ``ValueError``."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"--backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def require_backend(name: str, python: str, timeout_s: float = 120.0) -> None:
    """Raise ``BackendUnavailable`` when backend ``name`` cannot run in ``python`` (the
    servers' interpreter); same_host needs nothing beyond the connector."""
    probe = _PROBES.get(check_backend(name))
    if probe is None:
        return
    code = (
        f"import sys; {probe}; found = probe(isolated=True); print(found.reason); "
        "sys.exit(0 if found.available else 1)"
    )
    try:
        child = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendUnavailable(
            f"--backend {name}: could not ask {python} whether it can run: {exc}"
        ) from None
    if child.returncode == 0:
        return
    lines = (child.stdout.strip() or child.stderr.strip()).splitlines()
    why = lines[-1] if lines else f"exit status {child.returncode}"
    raise BackendUnavailable(
        f"--backend {name} cannot run in the vLLM servers' python ({python}): {why}; "
        + _INSTEAD[name]
    )


__all__ = ["BACKENDS", "BackendUnavailable", "check_backend", "require_backend"]
