"""The UCX environment a NIXL engine starts under: the user's settings first, then this adapter's defaults.

Rules: a variable already in the environment is never changed by a default; explicit overrides (the connector's
``ucx`` setting) are checked (UCX_* names, string values) and win over both; UCX reads its global options (modules,
logging) once per process, at the first engine, and each engine's transport options when that engine starts.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["DEFAULT_TLS", "check_ucx_overrides", "interface_of", "ucx_environment"]

#: TCP between hosts, shared memory and cross-memory attach within one ("sm"), and "self" for
#: an engine writing into its own memory. No RDMA: an RDMA transport is named explicitly.
DEFAULT_TLS = "tcp,self,sm"

# Transport names that need UCX's InfiniBand module ("all" and "^..." lists may use it too).
_IB_TRANSPORTS = ("rc", "ud", "dc", "ib", "mlx5", "verbs", "all", "^")
_SIOCGIFADDR = 0x8915


def check_ucx_overrides(where: str, value: Any) -> dict[str, str]:
    """``value`` as a {UCX_NAME: string} dict; raises ``ValueError`` naming the first bad entry."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where}: expected a mapping of UCX_* environment variables to strings, "
            f"got {type(value).__name__}"
        )
    checked = {}
    for name, text in value.items():
        if not isinstance(name, str) or not name.startswith("UCX_") or name == "UCX_":
            raise ValueError(
                f"{where}: key {name!r} is not a UCX environment variable "
                "(expected a name starting with UCX_, e.g. UCX_TLS)"
            )
        if not isinstance(text, str):
            raise ValueError(
                f"{where}[{name!r}]: expected a string, got {type(text).__name__} {text!r}"
            )
        checked[name] = text
    return checked


def interface_of(host: str) -> str | None:
    """The name of the local network interface that holds IPv4 address ``host``, or None."""
    try:
        wanted = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    if wanted.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(answer[20:24]) == str(wanted):
                return name
    return None


def ucx_environment(
    host: str,
    overrides: Mapping[str, str] | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Put the UCX variables an engine at ``host`` needs into ``environ`` (os.environ); returns what it set.

    Defaults, each only when the variable is unset: ``UCX_TLS=tcp,self,sm``;
    ``UCX_NET_DEVICES`` = the interface holding ``host`` (``lo`` for 127.0.0.1), so UCX
    listens and connects on that interface only; ``UCX_LOG_FILE=/dev/stderr`` (UCX logs to
    stdout otherwise); and, when the transports need no InfiniBand, ``UCX_MODULES=^ib``:
    the bundled InfiniBand module pulls a second copy of libnl-route into a process where
    rdma-core is installed, and that copy crashes in its destructor at process exit.
    """
    environ = os.environ if environ is None else environ
    overrides = check_ucx_overrides("ucx", overrides or {})
    applied: dict[str, str] = {}

    def put(name: str, value: str, *, default: bool) -> None:
        if default and name in environ:
            return
        environ[name] = value
        applied[name] = value

    for name, value in overrides.items():
        put(name, value, default=False)
    put("UCX_TLS", DEFAULT_TLS, default=True)
    device = interface_of(host) if host else None
    if device is not None:
        put("UCX_NET_DEVICES", device, default=True)
    put("UCX_LOG_FILE", "/dev/stderr", default=True)
    transports = [part.strip().lower() for part in environ["UCX_TLS"].split(",")]
    if not any(part.startswith(_IB_TRANSPORTS) for part in transports):
        put("UCX_MODULES", "^ib", default=True)
    return applied
