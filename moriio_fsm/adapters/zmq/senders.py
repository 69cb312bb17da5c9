"""Who may speak for a transfer: the sender names that peers' messages arrive under.

Rules: a sender is the canonical host a message's connection came from, followed by ``/``
and the hex of the CURVE key it authenticated with when CURVE is on; a transfer is bound to
the senders of the host its request named. Host names are resolved here, once per name and
minute at most, so that an address can be compared with them: ``addresses`` may wait for
the resolver, ``known_addresses`` never does (it answers from the cache, refreshing it in
the background, or says it does not know yet).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from .curve import CurveConfig
from .policy import canonical_host

__all__ = ["AddressCache", "sender_name", "expected_senders"]


def sender_name(host: str, key: str | None = None) -> str:
    """The sender a message is charged to: ``host`` or ``host/key`` (key in hex)."""
    return f"{host}/{key}" if key else host


def _lookup(name: str) -> tuple[str, ...]:
    found = {info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    # A Python built without IPv6 gives IPv6 answers as (int, bytes): no peer of this
    # process can come from one, so they are left out.
    return tuple(
        sorted(
            {
                str(canonical_host(address.split("%", 1)[0]))
                for address in found
                if isinstance(address, str)
            }
        )
    )


def _name_or_addresses(host: str) -> str | tuple[str, ...]:
    """``host``'s canonical name when it is a name to resolve; else its addresses already:
    an address stands for itself, and what is no host at all for none."""
    try:
        canonical = canonical_host(host)
    except ValueError:
        return ()
    if not isinstance(canonical, str):
        return (str(canonical),)
    return canonical


class AddressCache:
    """The addresses a host name stands for, looked up at most once per ``ttl_s`` per name.

    Bounded: past ``max_names`` names the cache starts over. A lookup that fails is
    remembered for the same time as an empty answer.
    """

    def __init__(
        self,
        ttl_s: float = 60.0,
        max_names: int = 256,
        lookup: Callable[[str], tuple[str, ...]] = _lookup,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._ttl = ttl_s
        self._max = max_names
        self._lookup = lookup
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[float, tuple[str, ...]]] = {}
        self._pending: set[str] = set()  # names a background lookup is resolving

    def addresses(self, host: str) -> tuple[str, ...]:
        """``host`` as canonical addresses: itself when it is an address, else what it resolves to."""
        canonical = _name_or_addresses(host)
        if not isinstance(canonical, str):
            return canonical
        now = self._clock()
        with self._lock:
            cached = self._answers.get(canonical)
        if cached is not None and now - cached[0] < self._ttl:
            return cached[1]
        return self._resolve(canonical)

    def known_addresses(self, host: str) -> tuple[str, ...] | None:
        """``host`` as canonical addresses without waiting: an address is itself; a name is
        what the cache holds (an answer past its time is still used while a background
        lookup refreshes it), or None while its first lookup runs in the background."""
        canonical = _name_or_addresses(host)
        if not isinstance(canonical, str):
            return canonical
        with self._lock:
            cached = self._answers.get(canonical)
            stale = cached is None or self._clock() - cached[0] >= self._ttl
            start = stale and canonical not in self._pending
            if start:
                self._pending.add(canonical)
        if start:
            threading.Thread(
                target=self._refresh, args=(canonical,), daemon=True, name="moriio-fsm-resolver"
            ).start()
        return None if cached is None else cached[1]

    def _refresh(self, name: str) -> None:
        try:
            self._resolve(name)
        finally:
            with self._lock:
                self._pending.discard(name)

    def _resolve(self, name: str) -> tuple[str, ...]:
        try:
            found = self._lookup(name)
        except (OSError, UnicodeError, ValueError):
            found = ()
        with self._lock:
            if len(self._answers) >= self._max:
                self._answers.clear()
            self._answers[name] = (self._clock(), found)
        return found


def expected_senders(host: str, curve: CurveConfig | None, cache: AddressCache) -> str | None:
    """The creating event's ``source`` that binds a transfer to the peer at ``host``: its
    addresses, each with the CURVE key this process expects from that host when CURVE is on,
    comma-separated; never waits for a resolver (None: ``host`` is a name not resolved yet).
    A name that resolves to nothing gives ``"-"``, a sender no message can come from."""
    addresses = cache.known_addresses(host)
    if addresses is None:
        return None
    if not addresses:
        return "-"
    key = None
    if curve is not None:
        from zmq.utils import z85

        key = z85.decode(curve.server_key_for(str(canonical_host(host)))).hex()
    return ",".join(sender_name(address, key) for address in addresses)
