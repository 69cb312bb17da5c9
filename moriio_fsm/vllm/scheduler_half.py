"""The connector's scheduler half: turns vLLM's scheduling decisions into step metadata.

It decides nothing about a transfer's lifecycle (the machines in the workers do); it
only says which requests load remotely, collects P's prompt blocks across prefill chunks,
and tells the workers when a transfer starts and when its request ended. What it keeps
per request is identity (ids, addresses, blocks so far), dropped when the request ends.
A transfer id drives one request only: a request whose id another request holds or held
is refused at once (D computes its prompt, P prefills without sending) and never reaches
the workers, so it can neither cross another request's load nor wait for a finished one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..logs import get_logger
from .metadata import (
    ReceiveStart,
    RefusedSend,
    RequestEnded,
    SendStart,
    StepMetadata,
    TraceLink,
)
from .params import PeerAddress, TransferParams, TransferParamsError, parse_transfer_params
from .settings import ConnectorSettings
from .transfer_ids import USED_BEFORE, TransferIdLedger, prompt_digest

log = get_logger("moriio_fsm.vllm")

# vLLM's request statuses by name: the enum's values differ between versions.
_PREFILL_COMPLETE = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")


@dataclass
class _Sender:
    """P's view of one request that sends its KV, until its whole prompt is scheduled."""

    params: TransferParams
    num_prompt_tokens: int
    block_ids: list[int]
    prompt_digest: str = ""
    started: bool = False


class SchedulerHalf:
    """``get_num_new_matched_tokens`` ... ``request_finished``, for one engine's scheduler."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        block_size: int,
        is_producer: bool,
        is_consumer: bool,
        own_address: PeerAddress,
    ):
        self.settings = settings
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.own_address = own_address
        self._senders: dict[str, _Sender] = {}
        self._receiving: dict[str, TransferParams] = {}
        self._ids = TransferIdLedger()
        self._refused: set[str] = set()  # requests whose transfer id was taken
        self._step = StepMetadata()
        self.counts = {
            "bad_params": 0,
            "sends_started": 0,
            "receives_started": 0,
            "requests_ended": 0,
            "transfer_ids_refused": 0,
        }

    # -- helpers ---------------------------------------------------------------------------

    def _params(self, request: Any) -> TransferParams | None:
        try:
            return parse_transfer_params(request.kv_transfer_params)
        except TransferParamsError as exc:
            self.counts["bad_params"] += 1
            log.warning("vllm.bad_transfer_params", request_id=request.request_id, error=str(exc))
            return None

    def _prompt_blocks(self, num_prompt_tokens: int) -> int:
        return math.ceil(num_prompt_tokens / self.block_size)

    def _claim(self, request: Any, params: TransferParams) -> bool:
        """Whether ``request`` may drive ``params.transfer_id``; a refusal is logged once
        with both requests and remembered until the request finishes."""
        req_id = request.request_id
        if req_id in self._refused:
            return False
        holder = self._ids.claim(params.transfer_id, req_id)
        if holder is None:
            return True
        self._refused.add(req_id)
        self.counts["transfer_ids_refused"] += 1
        log.warning(
            "vllm.transfer_id_in_use",
            transfer_id=params.transfer_id,
            request_id=req_id,
            held_by=holder,
            then=(
                "computing the prompt locally"
                if self.is_consumer
                else "prefilling without sending its KV"
            ),
        )
        if (
            self.is_producer
            and not self.settings.read_mode
            and params.peer is not None
            and holder == USED_BEFORE
        ):
            self._step.refused.append(RefusedSend(req_id, params.transfer_id, params.peer))
        return False

    def _trace(self, request: Any, params: TransferParams) -> None:
        """With OpenTelemetry on, tell the workers whose trace the transfer's spans join."""
        if self.settings.otel:
            from ..trace.otel_spans import trace_headers_of

            headers = trace_headers_of(getattr(request, "trace_headers", None))
            self._step.traces.append(TraceLink(params.transfer_id, request.request_id, headers))

    # -- vLLM's scheduler-side hooks ---------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._params(request)
        if params is None:
            return 0, False
        if params.do_remote_decode and self.is_producer:
            if request.request_id not in self._senders and self._claim(request, params):
                self._senders[request.request_id] = _Sender(
                    params, request.num_prompt_tokens, [], _digest(request)
                )
                self._trace(request, params)
            return 0, False
        if not (params.do_remote_prefill and self.is_consumer):
            return 0, False
        if not self._claim(request, params):
            return 0, False
        if params.peer is None:
            self.counts["bad_params"] += 1
            log.warning(
                "vllm.bad_transfer_params",
                request_id=request.request_id,
                error="do_remote_prefill without remote_host and ports",
                then="computing the prompt locally",
            )
            return 0, False
        loadable = _loadable(request, params)
        wanted = loadable - num_computed_tokens
        if self.settings.read_mode:
            needed = self._prompt_blocks(loadable) - num_computed_tokens // self.block_size
            if len(params.remote_block_ids) < needed:
                self.counts["bad_params"] += 1
                log.warning(
                    "vllm.bad_transfer_params",
                    request_id=request.request_id,
                    error=f"remote_block_ids has {len(params.remote_block_ids)} blocks, "
                    f"the prompt needs {needed}",
                    then="computing the prompt locally",
                )
                return 0, False
            if params.prompt_digest and params.prompt_digest != _digest(request, loadable):
                self.counts["bad_params"] += 1
                log.warning(
                    "vllm.bad_transfer_params",
                    request_id=request.request_id,
                    transfer_id=params.transfer_id,
                    error="remote_block_ids hold another prompt's KV (prompt_digest differs)",
                    then="computing the prompt locally",
                )
                return 0, False
        # The load is asynchronous in both modes: the forward thread never waits for it.
        return max(wanted, 0), wanted > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if not self.is_consumer:
            return
        params = self._params(request)
        if (
            params is None
            or not params.do_remote_prefill
            or params.peer is None
            or request.request_id in self._refused
        ):
            return
        # Plan the load once: a second call (more blocks after the load) must not.
        request.kv_transfer_params["do_remote_prefill"] = False
        self._receiving[request.request_id] = params
        local: tuple[int, ...] = ()
        remote: tuple[int, ...] = ()
        loadable = _loadable(request, params)
        if num_external_tokens > 0:
            ids = blocks.get_block_ids()[0]
            prompt = loadable  # the KV ends there; D computes any token after it
            first = (prompt - num_external_tokens) // self.block_size
            local = tuple(ids[first : self._prompt_blocks(prompt)])
            if self.settings.read_mode:
                remote = params.remote_block_ids[-len(local) :]
        self._step.receives.append(
            ReceiveStart(
                request.request_id,
                params.transfer_id,
                local,
                params.peer,
                remote,
                _digest(request, loadable),
            )
        )
        self.counts["receives_started"] += 1
        self._trace(request, params)

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        if self._senders and not self.settings.read_mode:
            self._collect_prompt_blocks(scheduler_output)
        step, self._step = self._step, StepMetadata()
        step.idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        return step

    def _collect_prompt_blocks(self, out: Any) -> None:
        """P in WRITE mode: a request's layers go to D once its whole prompt has blocks."""
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            sender = self._senders.get(new.req_id)
            if sender is not None and not sender.started:
                sender.block_ids = list(new.block_ids[0])
                self._maybe_start(
                    new.req_id, sender, new.num_computed_tokens + scheduled.get(new.req_id, 0)
                )
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ()) or ()
        for index, req_id in enumerate(cached.req_ids):
            sender = self._senders.get(req_id)
            if sender is None or sender.started:
                continue
            new_ids = cached.new_block_ids[index]
            if new_ids is not None:
                if req_id in resumed:
                    sender.block_ids = list(new_ids[0])
                else:
                    sender.block_ids.extend(new_ids[0])
            self._maybe_start(
                req_id, sender, cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
            )

    def _maybe_start(self, req_id: str, sender: _Sender, computed_after_step: int) -> None:
        if computed_after_step < sender.num_prompt_tokens:
            return
        sender.started = True
        blocks = tuple(sender.block_ids[: self._prompt_blocks(sender.num_prompt_tokens)])
        self._step.sends.append(
            SendStart(
                req_id, sender.params.transfer_id, blocks, sender.params.peer, sender.prompt_digest
            )
        )
        self.counts["sends_started"] += 1

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        if req_id in self._refused:
            self._refused.discard(req_id)
            return False, None  # its transfer id was another request's: nothing to end
        sender = self._senders.pop(req_id, None)
        received = self._receiving.pop(req_id, None)
        status = getattr(request.status, "name", str(request.status))
        aborted = status not in _PREFILL_COMPLETE
        params = sender.params if sender else received or self._params(request)
        if params is None:
            return False, None
        if sender is None and received is None:
            # Never looked at by the scheduler: its id may be another request's by now.
            holder = self._ids.holder(params.transfer_id, req_id)
            if holder is not None:
                log.warning(
                    "vllm.transfer_id_in_use",
                    transfer_id=params.transfer_id,
                    request_id=req_id,
                    held_by=holder,
                    then="ending the request alone",
                )
                return False, None
        self._ids.finish(params.transfer_id, req_id)
        if params.do_remote_decode and self.is_producer:
            if sender is None:  # ended before the scheduler ever looked at it
                sender = _Sender(params, request.num_prompt_tokens, [], _digest(request))
            return self._sender_finished(request, sender, block_ids, aborted)
        if (
            self.is_consumer
            and params.peer is not None
            and (received is not None or params.do_remote_prefill)
        ):
            # D: the worker's machine decides what the end means (release P, keep the
            # blocks until P's verdict); vLLM itself keeps the blocks of a waiting load.
            self._step.ended.append(
                RequestEnded(
                    req_id,
                    params.transfer_id,
                    "receive",
                    awaits_report=False,
                    aborted=aborted,
                    peer=params.peer,
                )
            )
            self.counts["requests_ended"] += 1
        return False, None

    def _sender_finished(
        self, request: Any, sender: _Sender, block_ids: list[int], aborted: bool
    ) -> tuple[bool, dict | None]:
        params = sender.params
        self.counts["requests_ended"] += 1
        if not self.settings.read_mode:
            # WRITE: once the prompt was scheduled a write from these blocks may be in
            # flight, so vLLM keeps them until the machine frees them.
            held = sender.started
            self._step.ended.append(
                RequestEnded(
                    request.request_id,
                    params.transfer_id,
                    "send",
                    awaits_report=held,
                    aborted=aborted or not held,
                    peer=params.peer,
                )
            )
            return held, None
        if aborted or not block_ids:
            return False, None  # D never learnt these blocks: nothing may read them
        blocks = tuple(block_ids[: self._prompt_blocks(sender.num_prompt_tokens)])
        self._step.ended.append(
            RequestEnded(
                request.request_id,
                params.transfer_id,
                "send",
                awaits_report=True,
                aborted=False,
                block_ids=blocks,
            )
        )
        me = self.own_address
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": params.transfer_id,
            "remote_block_ids": list(blocks),
            "remote_engine_id": me.engine_id,
            "remote_host": me.host,
            "remote_handshake_port": me.handshake_port,
            "remote_notify_port": me.notify_port,
            "remote_dp_rank": me.dp_rank,
            "remote_tp_size": me.tp_size,
            "prompt_digest": sender.prompt_digest,
            "remote_prompt_tokens": sender.num_prompt_tokens,
        }


def _digest(request: Any, tokens: int | None = None) -> str:
    """The fingerprint of the request's prompt, or of its first ``tokens`` tokens."""
    token_ids = getattr(request, "prompt_token_ids", None)
    if token_ids is not None and tokens is not None:
        token_ids = token_ids[:tokens]
    return prompt_digest(token_ids)


def _loadable(request: Any, params: TransferParams) -> int:
    """How many prompt tokens D loads: those P's KV covers (its ``remote_prompt_tokens``, READ mode), at most
    the whole prompt."""
    prompt = request.num_prompt_tokens
    return min(params.prompt_tokens, prompt) if params.prompt_tokens else prompt
