"""How a P/D request fails: what the client is told, and what the router acts on.

Rules: ``TransferFailed`` is the only failure a client sees, with its HTTP status and transfer;
``Unreachable`` and ``NeverSaw`` stay inside the router, which marks the instance down for them.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["WHERE_TO_LOOK", "NeverSaw", "TransferFailed", "Unreachable", "raise_prefill_error"]

#: What a D failure most often means behind this proxy, and where its story is.
WHERE_TO_LOOK = (
    " (D could not load the prompt's KV cache, or its engine failed; "
    "`moriio-fsm explain` on D's and P's connector traces with --transfer "
    "shows what happened to the transfer)"
)


class TransferFailed(Exception):
    """A request failed: the HTTP status, the message and kind the client gets, its transfer."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "kv_transfer_failed",
        transfer_id: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.transfer_id = status, message, kind, transfer_id

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "transfer_id": self.transfer_id}
        }


class Unreachable(Exception):
    """An instance could not be reached, or died under the request: mark it down."""


class NeverSaw(Exception):
    """The instance of ``role`` never got the request: mark it down, retry elsewhere."""

    def __init__(self, role: str, why: str):
        super().__init__(why)
        self.role, self.why = role, why


def raise_prefill_error(p_task: asyncio.Future, transfer_id: str) -> None:
    """Raise what ended P's part before D answered; a P that died is retried elsewhere."""
    error = p_task.exception()
    if isinstance(error, Unreachable):  # P died before D said anything: retry
        raise NeverSaw("prefill (died)", str(error))
    if error is not None:
        raise error
