"""``MoRIIOFSMConnector``: vLLM's KV connector interface over the project's machines.

Loaded by vLLM with ``KVTransferConfig(kv_connector="MoRIIOFSMConnector",
kv_connector_module_path="moriio_fsm.vllm.connector", kv_role=..., ...)``. vLLM builds it
once in the scheduler process and once per worker; each role delegates to its half
(``SchedulerHalf``, ``WorkerHalf``) and this class only translates vLLM's calls. Settings
are checked at construction: a bad key stops the engine at start, naming the key.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from ..adapters.zmq import default_bind_host
from ..layout import LayerKVFormat
from ..logs import get_logger, share_handlers_of
from .metadata import StepMetadata
from .metrics import FsmConnectorStats, FsmPromMetrics
from .params import PeerAddress
from .scheduler_half import SchedulerHalf
from .settings import ConnectorConfigError, ConnectorSettings

if TYPE_CHECKING:
    from .worker_half import WorkerHalf

log = get_logger("moriio_fsm.vllm")

_ROLES = {"kv_producer": ("send",), "kv_consumer": ("receive",)}


def _sides(kv_role: str | None) -> tuple[str, ...]:
    sides = _ROLES.get(kv_role or "")
    if sides is None:
        raise ConnectorConfigError(
            f"kv_role {kv_role!r}: MoRIIOFSMConnector runs a prefill instance (kv_producer) or "
            "a decode instance (kv_consumer); run P and D as separate instances"
        )
    return sides


def make_engine(settings: ConnectorSettings, host: str):
    """The transfer engine the ``backend`` setting names (mori.io and nixl are imported only here)."""
    if settings.backend == "same_host":
        from ..engines.same_host import CrossMemoryEngine
        from ..engines.same_host.strategy import engine_options

        # KV caches are registered before the first forward, so their pages can be shared.
        options = engine_options(settings.copy_strategy, settings.share_pages)
        return lambda key: CrossMemoryEngine(key, host, **options)
    if settings.backend == "nixl":
        from ..engines.nixl import NixlEngine

        return lambda key: NixlEngine(key, host, ucx=dict(settings.ucx))
    from ..engines.mori import MoriEngine

    return lambda key: MoriEngine(
        key,
        host,
        backend=settings.backend,
        qp_per_transfer=settings.qp_per_transfer,
        post_batch_size=settings.post_batch_size,
        num_worker_threads=settings.num_workers,
    )


class MoRIIOFSMConnector(KVConnectorBase_V1):
    """A KV connector whose every transfer is an explicit, checked state machine."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        share_handlers_of("vllm")  # the connector's warnings in the server's log
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        sides = _sides(transfer.kv_role)
        parallel = vllm_config.parallel_config
        self.host = self.settings.host_ip or os.environ.get("VLLM_HOST_IP") or default_bind_host()
        self.engine_id = str(transfer.engine_id)
        self.tp_size = int(parallel.tensor_parallel_size)
        self.dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        block_size = int(vllm_config.cache_config.block_size)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(
                self.settings,
                block_size=block_size,
                is_producer=sides == ("send",),
                is_consumer=sides == ("receive",),
                own_address=PeerAddress(
                    self.host,
                    self.settings.notify_port,
                    self.settings.handshake_port,
                    self.dp_rank,
                    self.tp_size,
                    self.engine_id,
                ),
            )
        else:
            self._worker = self._make_worker(vllm_config, kv_cache_config, sides, block_size)

    def _make_worker(self, vllm_config, kv_cache_config, sides, block_size) -> WorkerHalf:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from .amx import request_amx_permission
        from .worker_half import WorkerHalf

        request_amx_permission()  # before the first forward; harmless without AMX
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ConnectorConfigError(
                f"MoRIIOFSMConnector moves single-group KV caches; this "
                f"model has {len(groups)} KV cache groups"
            )
        self._kv_spec = groups[0].kv_cache_spec
        try:
            tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no distributed group (a test building the worker alone)
            tp_rank = 0
        return WorkerHalf(
            self.settings,
            engine_id=self.engine_id,
            sides=sides,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            dp_rank=self.dp_rank,
            make_engine=make_engine(self.settings, self.host),
            host=self.host,
        )

    def _scheduler_half(self) -> SchedulerHalf:
        """vLLM calls the scheduler-side methods only on the connector it built as the scheduler."""
        if self._scheduler is None:
            raise RuntimeError("MoRIIOFSMConnector: a scheduler-side call on a worker's connector")
        return self._scheduler

    def _worker_half(self) -> WorkerHalf:
        """vLLM calls the worker-side methods only on the connectors it built in its workers."""
        if self._worker is None:
            raise RuntimeError(
                "MoRIIOFSMConnector: a worker-side call on the scheduler's connector"
            )
        return self._worker

    # -- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler_half().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler_half().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        return self._scheduler_half().build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler_half().request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        return None

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        backend = self._attention_backend(kv_caches)
        kv_format = LayerKVFormat.from_vllm(self._kv_spec, attention_backend=backend)
        self._worker_half().register_kv_caches(
            kv_caches, kv_format, attention_backend=backend or ""
        )

    def _attention_backend(self, kv_caches) -> str | None:
        """The name of the backend that allocated the cache (it decides the layout)."""
        layers = self._vllm_config.compilation_config.static_forward_context
        for name in kv_caches:
            backend = getattr(layers.get(name), "attn_backend", None)
            if backend is not None:
                return backend.get_name()
        return None

    def bind_connector_metadata(self, connector_metadata) -> None:
        # Applied here, before the forward: vLLM may call start_load_kv only after it,
        # and this step's save_kv_layer calls must already know the transfers they feed.
        super().bind_connector_metadata(connector_metadata)
        self._worker_half().start_step(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None  # loads start from the step's metadata, asynchronously

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request runs once its KV landed

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        self._worker_half().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker_half().finish_saves()

    def get_finished(self, finished_req_ids):
        sending, recving = self._worker_half().finished()
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_half().load_errors()

    def get_kv_connector_stats(self):
        if self._worker is None:
            return None
        data = self._worker.interval_stats()
        stats = FsmConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return FsmConnectorStats(data=data) if data is not None else FsmConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return FsmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
