"""What the scheduler half tells the workers each step (vLLM's connector metadata).

The step metadata lists the transfers to start and the requests that finished, each with the
facts a worker needs to turn it into machine events. It is plain data: vLLM pickles it
from the scheduler process to every worker, and building it resets the scheduler half's
per-step lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import PeerAddress


@dataclass(frozen=True, slots=True)
class SendStart:
    """P: the whole prompt has blocks; its layers are saved (WRITE) or served (READ)."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    peer: PeerAddress | None
    prompt_digest: str = ""  # the prompt's fingerprint (``transfer_ids.prompt_digest``)


@dataclass(frozen=True, slots=True)
class ReceiveStart:
    """D: blocks are allocated for a remote load (``block_ids`` empty: nothing to load).

    ``remote_block_ids`` is P's list in READ mode (from P's response), empty in WRITE
    mode, where P learns D's blocks from ``remote_blocks``.
    """

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    peer: PeerAddress
    remote_block_ids: tuple[int, ...] = ()
    prompt_digest: str = ""  # the prompt's fingerprint, sent to P with the block ids


@dataclass(frozen=True, slots=True)
class RequestEnded:
    """A request that had a transfer finished in vLLM (``request_finished`` was called).

    ``awaits_report``: vLLM keeps the request's blocks until this connector reports the
    request (``finished_sending`` on P, ``finished_recving`` on D). ``aborted``: it did not
    end by its own stop condition. ``block_ids``: P's blocks in READ mode (served to D).
    """

    request_id: str
    transfer_id: str
    side: str  # "send" or "receive"
    awaits_report: bool
    aborted: bool
    block_ids: tuple[int, ...] = ()
    peer: PeerAddress | None = None


@dataclass(frozen=True, slots=True)
class RefusedSend:
    """P, WRITE: a request refused because an earlier, finished request used its transfer id;
    ``peer`` is the D its params named, which is told so if it allocates for that id."""

    request_id: str
    transfer_id: str
    peer: PeerAddress


@dataclass(frozen=True, slots=True)
class TraceLink:
    """With OpenTelemetry on: the request behind a transfer and its W3C trace headers
    (vLLM's ``Request.trace_headers``), which parent the transfer's spans in the workers."""

    transfer_id: str
    request_id: str
    headers: dict[str, str] | None = None


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One scheduler step's news for the workers, in the order they must be applied."""

    sends: list[SendStart] = field(default_factory=list)
    receives: list[ReceiveStart] = field(default_factory=list)
    ended: list[RequestEnded] = field(default_factory=list)
    refused: list[RefusedSend] = field(default_factory=list)
    traces: list[TraceLink] = field(default_factory=list)
    # The step runs no forward (nothing scheduled): its worker may spend the step helping
    # a peer's write in (copy assist) instead of returning at once to an idle loop.
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(self.sends or self.receives or self.ended or self.refused or self.traces)
