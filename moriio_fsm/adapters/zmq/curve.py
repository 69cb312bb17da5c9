"""Optional CURVE encryption for every control-plane socket: keys, trust and socket options.

Rules: with a ``CurveConfig`` listeners are CURVE servers and senders CURVE clients; only
authorised client keys are admitted (by ``zap.ZapHandler``); keys are checked at construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import zmq
from zmq.utils import z85

from .policy import canonical_host

__all__ = ["CurveConfig", "ZAP_DOMAIN"]

# The ZAP domain every CURVE server socket puts in its authentication requests.
ZAP_DOMAIN = b"moriio"


def _z85_key(value: bytes | str, name: str) -> bytes:
    key = value.encode("ascii") if isinstance(value, str) else bytes(value)
    if len(key) != 40:
        raise ValueError(f"{name}: expected a 40-character Z85 CURVE key, got {len(key)} bytes")
    try:
        z85.decode(key)
    except Exception:
        raise ValueError(f"{name}: not valid Z85") from None
    return key


@dataclass(frozen=True)
class CurveConfig:
    """This process's CURVE key pair and whom it trusts.

    ``authorized_client_keys``: client public keys a listener admits (this
    process's own public key is always admitted, so a deployment sharing one
    key pair needs nothing more).  ``server_keys``: a peer host's server public
    key by host; hosts are canonicalised here (as ``PeerPolicy`` does), so any
    spelling of a host finds its key.  Hosts not listed are assumed to use this
    process's own public key.  Keys are Z85 text (40 characters), as ``zmq.curve_keypair``
    makes them.  Construction raises ``ValueError`` naming a malformed key.
    """

    public_key: bytes
    secret_key: bytes
    authorized_client_keys: frozenset[bytes] = field(default_factory=frozenset)
    server_keys: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _z85_key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", _z85_key(self.secret_key, "secret_key"))
        keys = frozenset(_z85_key(k, "authorized_client_keys") for k in self.authorized_client_keys)
        object.__setattr__(self, "authorized_client_keys", keys)
        # Keyed by canonical host, the form the transport looks them up in: "[::1]",
        # "::1" and "0:0::1" are one host, as are "Node-A." and "node-a".
        servers: dict[str, bytes] = {}
        for host, key in dict(self.server_keys).items():
            try:
                canonical = str(canonical_host(host))
            except ValueError as exc:
                raise ValueError(
                    f"server_keys[{host!r}]: expected an IP address or host name ({exc})"
                ) from None
            checked = _z85_key(key, f"server_keys[{host!r}]")
            if servers.get(canonical, checked) != checked:
                raise ValueError(
                    f"server_keys[{host!r}]: another entry names the same host {canonical!r} "
                    "with a different key"
                )
            servers[canonical] = checked
        object.__setattr__(self, "server_keys", MappingProxyType(servers))

    @classmethod
    def generate(cls, authorized_client_keys: Iterable[bytes] = ()) -> CurveConfig:
        """A fresh key pair (requires libzmq built with CURVE)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret, frozenset(authorized_client_keys))

    def authorized_raw_keys(self) -> frozenset[bytes]:
        """The admitted client keys as 32-byte binary, as ZAP presents them."""
        return frozenset(z85.decode(k) for k in self.authorized_client_keys | {self.public_key})

    def server_key_for(self, host: str) -> bytes:
        """The server key to expect from ``host`` (canonical text, as ``PeerPolicy.check`` returns)."""
        return self.server_keys.get(host, self.public_key)

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)

    def apply_client(self, sock: zmq.Socket, host: str) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key_for(host))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
