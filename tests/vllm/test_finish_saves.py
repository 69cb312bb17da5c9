"""What P's worker tells its machine when a forward ends: each transfer's layers not scheduled
yet, in one layers_scheduled step, whatever was scheduled layer by layer during the forward."""

from __future__ import annotations

import torch
from harness import free_port

from moriio_fsm.engines.same_host import CrossMemoryEngine
from moriio_fsm.layout import CPU_ATTN, LayerKVFormat
from moriio_fsm.machines.bitmaps import layer_indices
from moriio_fsm.vllm.metadata import SendStart, StepMetadata
from moriio_fsm.vllm.settings import ConnectorSettings
from moriio_fsm.vllm.worker_half import WorkerHalf

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def producer(posting: str) -> WorkerHalf:
    settings = ConnectorSettings.from_extra_config(
        {
            "backend": "same_host",
            "notify_port": free_port(),
            "handshake_port": free_port(),
            "host_ip": "127.0.0.1",
            "write_posting": posting,
        }
    )
    worker = WorkerHalf(
        settings,
        engine_id="P",
        sides=("send",),
        tp_rank=0,
        tp_size=1,
        dp_rank=0,
        host="127.0.0.1",
        make_engine=lambda key: CrossMemoryEngine(key, "127.0.0.1"),
    )
    kv_format = LayerKVFormat(16, 2, 8, attention_backend=CPU_ATTN)
    worker.register_kv_caches(
        {name: torch.zeros(6, 2, 16, 16) for name in LAYERS}, kv_format, attention_backend=CPU_ATTN
    )
    return worker


def scheduling_steps(worker: WorkerHalf) -> list:
    """Record (transfer, kind, layers) of every scheduling event the worker dispatches."""
    seen = []
    dispatch = worker.dispatch

    def recording(side, event):
        if event.kind == "layer_scheduled":
            seen.append((event.transfer_id, event.kind, (event.layer,)))
        elif event.kind == "layers_scheduled":
            seen.append((event.transfer_id, event.kind, layer_indices(event.layers)))
        return dispatch(side, event)

    worker.dispatch = recording
    return seen


def test_after_the_forward_each_transfer_gets_its_layers_in_one_step():
    worker = producer("after_forward")
    try:
        seen = scheduling_steps(worker)
        worker.start_step(
            StepMetadata(
                sends=[SendStart("p-1", "tx-a", (1, 2), None), SendStart("p-2", "tx-b", (3,), None)]
            )
        )
        for name in LAYERS:
            worker.save_layer(name)  # after_forward: nothing goes during the forward
        worker.finish_saves()
        assert seen == [
            ("tx-a", "layers_scheduled", (0, 1, 2, 3)),
            ("tx-b", "layers_scheduled", (0, 1, 2, 3)),
        ]
        for tid in ("tx-a", "tx-b"):
            record = worker.drivers["send"].table.get(tid)
            assert record.scheduled == 0b1111 and record.writes_expected == 4
    finally:
        worker.close()


def test_layers_saved_during_the_forward_are_not_scheduled_again_at_its_end():
    worker = producer("layerwise")
    try:
        seen = scheduling_steps(worker)
        worker.start_step(StepMetadata(sends=[SendStart("p-1", "tx-a", (1, 2), None)]))
        worker.save_layer(LAYERS[0])
        worker.save_layer(LAYERS[2])
        worker.save_layer(LAYERS[2])  # a layer saved twice is scheduled once
        worker.save_layer("model.layers.9.not_a_cache")
        worker.finish_saves()
        assert seen == [
            ("tx-a", "layer_scheduled", (0,)),
            ("tx-a", "layer_scheduled", (2,)),
            ("tx-a", "layers_scheduled", (1, 3)),
        ]
        assert worker.drivers["send"].table.get("tx-a").writes_expected == 4
        # The next forward starts afresh: nothing of this one is remembered as saved.
        worker.start_step(StepMetadata())
        worker.finish_saves()
        assert len(seen) == 3
    finally:
        worker.close()
