"""``WatchConnector``: runs the project's watch machines beside any vLLM KV connector.

Loaded with ``kv_connector="WatchConnector", kv_connector_module_path="moriio_fsm.vllm.watch"``
and ``kv_connector_extra_config={"inner": {"kv_connector": "NixlConnector", ...}, ...}``
(``watch_config.py``). Rules: every call vLLM makes goes to the inner connector unchanged
(same arguments, same return value, same exception); the watch sees the call and its answer
afterwards and changes nothing vLLM does (no rescue: failing a stuck load would let the
inner connector's late bytes land in blocks vLLM reused). Only the stats are wrapped, the
inner connector's data inside them untouched (``watch_stats.py``). A watch failure is
logged once and never reaches vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ..logs import get_logger, share_handlers_of
from .watch_config import inner_class, inner_transfer_config, inner_vllm_config, read_settings
from .watch_metrics import empty_watch_data
from .watch_stats import WatchPromMetrics, WatchStats, class_by_name

log = get_logger("moriio_fsm.vllm.watch")


def _rank_of() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no distributed group (a connector built alone)
        return 0


class WatchConnector(KVConnectorBase_V1):
    """Any KV connector, watched: the inner connector does the work, the machines watch."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        share_handlers_of("vllm")
        outer = vllm_config.kv_transfer_config
        self.settings = read_settings(outer.kv_connector_extra_config)
        inner_config = inner_vllm_config(vllm_config)
        transfer = inner_config.kv_transfer_config
        self.inner_name = [transfer.kv_connector, transfer.kv_connector_module_path]
        self._inner = inner_class(transfer)(inner_config, role, kv_cache_config)
        self._watch_failures = 0
        self.scheduler_watch: Any = None
        self.worker_watch: Any = None
        self._start_watch(vllm_config, role, str(outer.engine_id))

    def _start_watch(self, vllm_config: Any, role: KVConnectorRole, engine_id: str) -> None:
        from ..trace import TraceRecorder

        dp = int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        ring = self.settings.trace_ring_size
        if role == KVConnectorRole.SCHEDULER:
            from .watch_scheduler import SchedulerWatch

            template = self.settings.trace_file
            file = template and template.replace("{engine_id}", engine_id).replace(
                "{dp_rank}", str(dp)
            )
            side = f"{engine_id}-dp{dp}"
            recorder = TraceRecorder(side, ring=ring, file=file or None)
            spans = None
            if self.settings.otel:
                from ..trace.otel_spans import TransferSpans

                # P's span closes when the send is reported: the linger after it is the
                # watch's own bookkeeping, not the transfer's.
                spans = TransferSpans(side, closing={"watch_producer": ("sent",)})
            self.scheduler_watch = SchedulerWatch(self.settings, recorder, side, spans=spans)
        else:
            from .watch_worker_side import WorkerWatch

            rank = f"{engine_id}-dp{dp}-tp{_rank_of()}"
            self.worker_watch = WorkerWatch(rank, TraceRecorder(rank, ring=ring))

    def __getattr__(self, name: str) -> Any:
        # What the inner connector has beyond the base class (its own methods, newer hooks).
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def _see(self, watch: Any, hook: str, *args: Any) -> None:
        """Let the watch see a call the inner connector answered; never raise to vLLM."""
        if watch is None:
            return
        try:
            getattr(watch, hook)(*args)
        except Exception:
            self._watch_failures += 1
            if self._watch_failures <= 10:
                log.exception("watch.hook_failed", hook=hook, failures=self._watch_failures)

    @property
    def inner(self) -> KVConnectorBase_V1:
        """The connector this one watches."""
        return self._inner

    # -- properties and class-level questions: the inner connector's answers ------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        transfer = inner_transfer_config(kv_transfer_config)
        return inner_class(transfer).supports_sleep_mode(transfer)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        inner = inner_vllm_config(vllm_config)
        return inner_class(inner.kv_transfer_config).get_required_kvcache_layout(inner)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = (extra_config or {}).get("inner") or {}
        found = class_by_name(str(inner.get("kv_connector")), inner.get("kv_connector_module_path"))
        if found is None:
            return False
        return found.requires_piecewise_for_cudagraph(inner.get("kv_connector_extra_config") or {})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> WatchStats:
        return WatchStats(data=data) if data is not None else WatchStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        inner = inner_vllm_config(vllm_config)
        inner_prom = inner_class(inner.kv_transfer_config).build_prom_metrics(
            inner, metric_types, labelnames, per_engine_labelvalues
        )
        return WatchPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, inner_prom
        )

    # -- worker side -----------------------------------------------------------------------

    def get_mem_pool_context(self):
        return self._inner.get_mem_pool_context()

    def register_kv_caches(self, kv_caches):
        return self._inner.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        return self._inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        return self._inner.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation):
        return self._inner.set_host_xfer_buffer_ops(copy_operation)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        answer = self._inner.bind_connector_metadata(connector_metadata)
        self._see(self.worker_watch, "step_bound")
        return answer

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        answer = self._inner.clear_connector_metadata()
        self._see(self.worker_watch, "step_cleared")
        return answer

    def handle_preemptions(self, kv_connector_metadata):
        return self._inner.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs):
        answer = self._inner.start_load_kv(forward_context, **kwargs)
        self._see(self.worker_watch, "load_started")
        return answer

    def wait_for_layer_load(self, layer_name):
        return self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        answer = self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        self._see(self.worker_watch, "layer_saved", layer_name)
        return answer

    def wait_for_save(self):
        answer = self._inner.wait_for_save()
        self._see(self.worker_watch, "saves_waited")
        return answer

    def finish_forward(self):
        return self._inner.finish_forward()

    def reset_capture_state(self):
        return self._inner.reset_capture_state()

    def get_finished(self, finished_req_ids):
        answer = self._inner.get_finished(finished_req_ids)
        self._see(self.worker_watch, "finished", answer)
        return answer

    def get_transfer_results(self, finished_req_ids):
        answer = self._inner.get_transfer_results(finished_req_ids)
        sets = (getattr(answer, "finished_sending", ()), getattr(answer, "finished_recving", ()))
        self._see(self.worker_watch, "finished", sets)
        return answer

    def get_block_ids_with_load_errors(self):
        answer = self._inner.get_block_ids_with_load_errors()
        self._see(self.worker_watch, "load_errors", answer)
        return answer

    def get_kv_connector_stats(self):
        inner = self._inner.get_kv_connector_stats()
        if inner is not None and not isinstance(inner, KVConnectorStats):
            return inner  # nothing vLLM could aggregate with the watch's: passed on as is
        watch = (
            self.scheduler_watch.metrics.snapshot()
            if self.scheduler_watch is not None
            else empty_watch_data()
        )
        stats = WatchStats(
            data={
                "inner": None if inner is None else inner.data,
                "inner_class": list(self.inner_name),
                "watch": watch,
            }
        )
        return None if inner is None and stats.is_empty() else stats

    def get_kv_connector_kv_cache_events(self):
        return self._inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self):
        return self._inner.get_handshake_metadata()

    def set_xfer_handshake_metadata(self, metadata) -> None:
        return self._inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        return self._inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def build_connector_worker_meta(self):
        return self._inner.build_connector_worker_meta()

    def get_finished_count(self):
        return self._inner.get_finished_count()

    def shutdown(self):
        try:
            return self._inner.shutdown()
        finally:
            self._see(self.worker_watch, "close")
            self._see(self.scheduler_watch, "close")

    # -- scheduler side --------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        return self._inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        return self._inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request):
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        answer = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._see(self.scheduler_watch, "matched", request, answer)
        return answer

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        answer = self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        self._see(self.scheduler_watch, "allocated", request, blocks, num_external_tokens)
        return answer

    def build_connector_meta(self, scheduler_output):
        answer = self._inner.build_connector_meta(scheduler_output)
        self._see(self.scheduler_watch, "step_built")
        return answer

    def on_new_request(self, request) -> None:
        return self._inner.on_new_request(request)

    def update_connector_output(self, connector_output):
        answer = self._inner.update_connector_output(connector_output)
        self._see(self.scheduler_watch, "output", connector_output)
        return answer

    def request_finished(self, request, block_ids):
        answer = self._inner.request_finished(request, block_ids)
        self._see(self.scheduler_watch, "finished", request, answer)
        return answer

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads):
        return self._inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self):
        return self._inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._inner.has_pending_push_work()

    def reset_cache(self):
        return self._inner.reset_cache()
