"""Which peers this process may dial: one check for every outbound connection.

Rules: every host is canonicalised, then matched against trusted names, addresses and CIDR ranges (only loopback
when none are configured); an address is dialled exactly as checked, and a name is never resolved here.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable

from .errors import UntrustedPeerError

__all__ = ["PeerPolicy", "canonical_host"]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_LOOPBACK: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)


def _parse_ip(text: str) -> IPAddress | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:a.b.c.d is the IPv4 peer a.b.c.d
    return address


def canonical_host(host: str) -> str | IPAddress:
    """Return ``host`` as an IP address object or a lower-case host name.

    Raises ``ValueError`` saying why when ``host`` is not a plain address or a
    syntactically valid DNS name (this includes legacy numeric forms such as
    ``127.1`` or ``0x7f000001`` that resolvers would quietly turn into addresses).
    """
    if type(host) is not str:
        raise ValueError(f"expected a string, got {type(host).__name__}")
    text = host
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text:
        raise ValueError("empty host")
    address = _parse_ip(text)
    if address is not None:
        return address
    name = text.lower()
    if name.endswith("."):
        name = name[:-1]
    if len(name) > 253 or not name:
        raise ValueError("not a valid host name (length)")
    labels = name.split(".")
    if not all(_LABEL.match(label) for label in labels):
        raise ValueError("not an IP address or a valid host name")
    try:
        socket.inet_aton(name)
    except OSError:
        return name
    raise ValueError("ambiguous numeric address; write it as a dotted-quad IPv4 or an IPv6 address")


class PeerPolicy:
    """Trusted peers: host names, IP addresses and CIDR ranges (IPv4 and IPv6).

    ``check`` is the single gate every outbound connection passes.  Hosts arrive in
    client-controlled request parameters, so each one is canonicalised (IPv4/IPv6
    literals, IPv4-mapped IPv6, brackets, case, trailing dot) before it is matched.
    Construction raises ``ValueError`` naming the first entry that is not a valid
    name, address or network.

    What the check guarantees, precisely: an address literal is dialled exactly as
    checked.  A host *name* is trusted as a name and never resolved here; libzmq
    resolves it when it connects and again at every reconnect, so the name's DNS
    decides which address is reached, and whoever controls that DNS can point a
    trusted name anywhere (DNS rebinding is not prevented for names).  Where that
    matters, trust addresses or CIDR ranges rather than names, or turn on CURVE so
    an impostor cannot authenticate.
    """

    def __init__(self, trusted: Iterable[str] = ()) -> None:
        networks: list[IPNetwork] = []
        names: set[str] = set()
        for entry in trusted:
            if type(entry) is not str:
                raise ValueError(f"trusted peer {entry!r}: expected a string")
            text = entry.strip()
            if "/" in text:
                try:
                    network = ipaddress.ip_network(text.strip("[]"), strict=False)
                except ValueError as exc:
                    raise ValueError(f"trusted peer {entry!r}: not a CIDR range ({exc})") from None
                if isinstance(network, ipaddress.IPv6Network) and network.prefixlen >= 96:
                    mapped = network.network_address.ipv4_mapped
                    if mapped is not None:
                        network = ipaddress.ip_network(f"{mapped}/{network.prefixlen - 96}")
                networks.append(network)
                continue
            try:
                canonical = canonical_host(text)
            except ValueError as exc:
                raise ValueError(f"trusted peer {entry!r}: {exc}") from None
            if isinstance(canonical, str):
                names.add(canonical)
            else:
                networks.append(ipaddress.ip_network(canonical))
        self.loopback_only = not networks and not names
        if self.loopback_only:
            networks.extend(_LOOPBACK)
            names.add("localhost")
        self._networks = tuple(networks)
        self._names = frozenset(names)
        # Verdicts per host string as given; bounded, and cleared rather than
        # evicted one by one since a host list is small in practice.
        self._verdicts: dict[str, str | UntrustedPeerError] = {}

    def __repr__(self) -> str:
        entries = sorted(self._names) + [str(n) for n in self._networks]
        return f"PeerPolicy({entries!r})"

    def check(self, host: str) -> str:
        """Return the canonical text to dial for ``host``, or raise ``UntrustedPeerError``.

        IPv6 addresses come back without brackets; callers add them for URLs.
        Safe to call from any thread.
        """
        verdict = self._verdicts.get(host) if type(host) is str else None
        if verdict is None:
            verdict = self._decide(host)
            if type(host) is str:
                if len(self._verdicts) >= 1024:
                    self._verdicts.clear()
                self._verdicts[host] = verdict
        if isinstance(verdict, str):
            return verdict
        raise UntrustedPeerError(verdict.host, verdict.canonical, verdict.reason)

    def _decide(self, host: str) -> str | UntrustedPeerError:
        try:
            return self._check_uncached(host)
        except UntrustedPeerError as refusal:
            return refusal

    def _check_uncached(self, host: str) -> str:
        try:
            canonical = canonical_host(host)
        except ValueError as exc:
            raise UntrustedPeerError(str(host), str(host), str(exc)) from None
        if isinstance(canonical, str):
            if canonical in self._names:
                return canonical
            raise UntrustedPeerError(host, canonical, "host name is not in the trusted peers")
        if canonical.is_unspecified or canonical.is_multicast:
            raise UntrustedPeerError(host, str(canonical), "not a unicast address")
        for network in self._networks:
            if canonical.version == network.version and canonical in network:
                return str(canonical)
        reason = (
            "only loopback is trusted when no peers are configured"
            if self.loopback_only
            else "address is not in the trusted peers"
        )
        raise UntrustedPeerError(host, str(canonical), reason)

    def admits_address(self, address: str, addresses_of: Callable[[str], Iterable[str]]) -> bool:
        """Whether a connection from ``address`` (an IP literal, as libzmq reports a peer)
        comes from a trusted peer: an address or range this policy lists, or an address one
        of its host names stands for (``addresses_of(name)``: canonical addresses)."""
        try:
            canonical = canonical_host(address)
        except ValueError:
            return False
        if isinstance(canonical, str):
            return False  # libzmq reports addresses, never names
        if any(canonical.version == n.version and canonical in n for n in self._networks):
            return True
        text = str(canonical)
        return any(text in addresses_of(name) for name in sorted(self._names))

    def is_trusted(self, host: str) -> bool:
        try:
            self.check(host)
        except UntrustedPeerError:
            return False
        return True
