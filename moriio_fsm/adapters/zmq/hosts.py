"""Which address of this host the transport listens on when none is configured.

Rules: the answer is a concrete address that peers can reach, never the wildcard and
never link-local; finding it sends no packet and never raises.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["default_bind_host"]

# Documentation-only destinations (RFC 5737, RFC 3849): routed, never contacted.
_ROUTE_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))


def _route_address(family: int, target: str) -> str | None:
    """The local address the kernel would send from towards ``target``, or None.

    A UDP ``connect`` only picks a route; no packet leaves the host.
    """
    try:
        probe = socket.socket(family, socket.SOCK_DGRAM)
    except OSError:
        return None  # this address family is not available here
    try:
        probe.connect((target, 9))
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    if not address or ipaddress.ip_address(address.split("%", 1)[0]).is_unspecified:
        return None
    if address.lower().startswith("fe80"):
        return None  # link-local: not reachable by peers without a scope id
    return address


def default_bind_host() -> str:
    """This host's own routable address, never the wildcard.

    Tries the IPv4 route first, then the IPv6 one, so an IPv6-only host gets its
    global IPv6 address; then the host name's addresses (either family); then
    loopback (``127.0.0.1``, or ``::1`` where IPv4 is unavailable).
    """
    for family, target in _ROUTE_PROBES:
        address = _route_address(family, target)
        if address is not None:
            return address
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for _family, _type, _proto, _name, sockaddr in infos:
        found = sockaddr[0]
        # A Python built without IPv6 gives IPv6 answers as (int, bytes): not usable here.
        if isinstance(found, str) and not found.lower().startswith("fe80"):
            return found
    return "127.0.0.1" if _route_address(socket.AF_INET, "127.0.0.1") is not None else "::1"
