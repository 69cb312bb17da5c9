"""Options and endpoints shared by every TCP socket the transport's I/O thread opens.

Rules: every socket gets TCP keepalive and IPv6; every server socket caps its frame
size before anything is allocated and admits peers only through ZAP (trusted addresses;
with CURVE on, authorised keys); a sender connects from the address its transport listens
on, so that its peers see it come from the host they know it by.
"""

from __future__ import annotations

import ipaddress

import zmq

from ...logs import get_logger
from .config import TransportConfig
from .curve import ZAP_DOMAIN

__all__ = ["bind", "server_socket", "set_keepalive", "source_for", "tcp_url"]

log = get_logger("moriio_fsm.adapters.zmq")


def tcp_url(host: str, port: int, source: str | None = None) -> str:
    """The ZeroMQ endpoint of ``host:port``; an IPv6 literal goes in brackets. With
    ``source`` (an address of this host, of the same family), connections leave from it."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if source is None:
        return f"tcp://{target}"
    origin = f"[{source}]:0" if ":" in source else f"{source}:0"
    return f"tcp://{origin};{target}"


def source_for(local: str | None, host: str) -> str | None:
    """The address a connection to ``host`` leaves from: ``local`` (the address this
    transport listens on) when both are addresses of one family and ``local`` is not a
    wildcard; None (the kernel's choice) otherwise, and for host names."""
    if not local:
        return None
    try:
        mine, theirs = ipaddress.ip_address(local), ipaddress.ip_address(host)
    except ValueError:
        return None
    if mine.version != theirs.version or mine.is_unspecified:
        return None
    if mine.is_loopback and not theirs.is_loopback:
        return None  # a loopback address cannot reach another host
    return str(mine)


def set_keepalive(sock: zmq.Socket, config: TransportConfig) -> None:
    """TCP keepalive, so a peer that vanished without a FIN is noticed; IPv6 allowed."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, config.tcp_keepalive_idle_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, config.tcp_keepalive_interval_s)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, config.tcp_keepalive_count)
    sock.setsockopt(zmq.IPV6, 1)


def server_socket(
    ctx: zmq.Context, config: TransportConfig, kind: int, max_bytes: int
) -> zmq.Socket:
    """An unbound server socket of ``kind`` that refuses frames above ``max_bytes``."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, config.recv_hwm)
    sock.setsockopt(zmq.SNDHWM, config.send_hwm)
    # libzmq drops the connection of a peer that sends a larger frame before
    # allocating it: the first line of defence against memory floods.
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    set_keepalive(sock, config)
    # Every connection is put to the ZAP handler (zap.py) before it may send a byte: its
    # address must be trusted, and with CURVE on its key authorised.
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    if config.curve is not None:
        config.curve.apply_server(sock)
    return sock


def bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind ``sock`` to ``host:port`` (0: an ephemeral port); returns the port bound."""
    if host in ("*", "0.0.0.0", "::"):
        log.warning(
            "zmq.bind_all_interfaces",
            host=host,
            hint="any host that can reach this port can send control messages",
        )
    if port == 0:
        return sock.bind_to_random_port(tcp_url(host, 0).rsplit(":", 1)[0])
    sock.bind(tcp_url(host, port))
    return port
