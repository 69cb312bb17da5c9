"""Transfer ids this worker refuses: a request may not start a transfer whose id is taken.

Rules: an id is taken while a live transfer (in the directory) or a remembered one (in a
machine's table) has it. A refused request is remembered until it ends, so that its end
reaches no other request's machine; the memory is bounded, oldest first out.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..logs import get_logger
from ..runtime.table import TransferTable
from .directory import TransferDirectory

log = get_logger("moriio_fsm.vllm")

#: Refused requests remembered at most (each until its end).
MAX_REFUSED = 1 << 16


class IdRefusals:
    """Which requests were refused their transfer id, and whether one may start."""

    def __init__(self, directory: TransferDirectory, tables: Mapping[str, TransferTable]):
        self._directory = directory
        self._tables = tables
        self._refused: dict[str, str] = {}  # request id -> the transfer id it was refused

    def may_start(self, side: str, request_id: str, transfer_id: str) -> bool:
        """Whether ``request_id`` may start ``transfer_id`` on ``side``; a refusal is logged
        with both requests and remembered until the request ends."""
        holder = self._holder_of(side, transfer_id)
        if holder is None:
            return True
        self.remember(request_id, transfer_id)
        log.warning(
            "vllm.transfer_id_in_use",
            transfer_id=transfer_id,
            request_id=request_id,
            held_by=holder,
            then="refused: a load fails (vLLM's load failure policy), a send does not start",
        )
        return False

    def remember(self, request_id: str, transfer_id: str) -> None:
        if len(self._refused) >= MAX_REFUSED:
            self._refused.pop(next(iter(self._refused)))
        self._refused[request_id] = transfer_id

    def forget(self, request_id: str) -> bool:
        """The request ended: forget it; True when it had been refused."""
        return self._refused.pop(request_id, None) is not None

    def _holder_of(self, side: str, transfer_id: str) -> str | None:
        info = self._directory.get(transfer_id)
        if info is not None:
            return f"live request {info.request_id!r}"
        state = self._tables[side].state_of(transfer_id)
        return None if state is None else f"a transfer of this id that is {state!r}"
