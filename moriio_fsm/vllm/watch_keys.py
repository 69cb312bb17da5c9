"""The key that joins P's and D's watch traces of one request, and the request ids bound to it.

Rules: the key is the ``transfer_id`` a request's ``kv_transfer_params`` carries (MoRIIO,
Mooncake, this project's connector); without one, P's request id, which D learns as
``remote_request_id`` (NIXL); without either, the request's own id. Anything else in the
params (ill-typed, too long, not a mapping) is ignored, never raised. Request ids map to
keys in a bounded table: the oldest bindings go first, so a flood cannot grow memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

MAX_KEY_LENGTH = 256
MAX_BINDINGS = 1 << 16


def _text(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_KEY_LENGTH:
        return value
    return None


def transfer_params(request: Any) -> dict:
    """The request's ``kv_transfer_params``, or an empty dict when it has none usable."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def wants_send(request: Any) -> bool:
    """The request asks for its KV to be sent to a decode instance."""
    return transfer_params(request).get("do_remote_decode") is True


def producer_key(request: Any) -> str:
    """P's key of ``request``: its transfer id, else its own request id."""
    params = transfer_params(request)
    return _text(params.get("transfer_id")) or str(request.request_id)


def consumer_key(request: Any) -> str:
    """D's key of ``request``: the transfer id, else P's request id, else its own id."""
    params = transfer_params(request)
    return (
        _text(params.get("transfer_id"))
        or _text(params.get("remote_request_id"))
        or str(request.request_id)
    )


class RequestKeys:
    """Request id -> transfer key, bounded (oldest first out); thread-safe."""

    def __init__(self, capacity: int = MAX_BINDINGS):
        self._capacity = capacity
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._requests: dict[str, str] = {}
        self._lock = threading.Lock()

    def bind(self, request_id: str, key: str) -> None:
        with self._lock:
            self._keys[request_id] = key
            self._keys.move_to_end(request_id)
            self._requests[key] = request_id
            while len(self._keys) > self._capacity:
                old_request, old_key = self._keys.popitem(last=False)
                if self._requests.get(old_key) == old_request:
                    del self._requests[old_key]

    def key_of(self, request_id: Any) -> str:
        """The key bound to ``request_id``, else the id itself (an unknown id stays unknown)."""
        text = request_id if isinstance(request_id, str) else repr(request_id)
        with self._lock:
            return self._keys.get(text, text)

    def request_of(self, key: str) -> str:
        with self._lock:
            return self._requests.get(key, "")

    def __len__(self) -> int:
        return len(self._keys)
