"""A P/D pair of vLLM's real schedulers with the connector's real halves, and a stand-in forward.

Each ``Instance`` is one vLLM engine cut at the model: vLLM's own ``Scheduler`` (which
builds the connector's scheduler half itself, from the ``KVTransferConfig``), the
connector's worker half with a KV cache of real tensors, real ZeroMQ sockets on
127.0.0.1 and the same-host engine. ``step()`` does what vLLM's model runner does with
a connector, in vLLM's order; the "forward" writes each token's KV as a function of the
token and its position, and samples a token that depends on the KV the request's blocks
hold, so a block that did not arrive changes the output.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from moriio_fsm.vllm.connector import MoRIIOFSMConnector

BLOCK_SIZE = 16
NUM_BLOCKS = 48
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD_SIZE = 2, 8
EOS = 0


def page_aligned_full(shape: tuple[int, ...], value: float) -> torch.Tensor:
    """A float32 tensor of ``shape`` filled with ``value`` that starts on a page boundary."""
    page = os.sysconf("SC_PAGE_SIZE")
    count = math.prod(shape)
    whole = torch.full((count + page // 4,), value)
    skip = (-whole.data_ptr() % page) // 4
    return whole[skip : skip + count].view(shape)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_dir(root) -> str:
    path = root / "tiny-llama"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": HEADS,
                "head_dim": HEAD_SIZE,
                "num_hidden_layers": len(LAYERS),
                "vocab_size": 1000,
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "torch_dtype": "float32",
            }
        )
    )
    return str(path)


def token_kv(token: int, position: int, layer: int) -> float:
    """The value every element of one token's K and V takes (exact in float32)."""
    return float((token * 131 + position * 7 + layer * 1009) % 65521)


@dataclass
class Instance:
    """One engine: scheduler (with the connector's scheduler half) + worker half + KV cache."""

    name: str
    kv_role: str
    read_mode: bool
    model: str
    extra: dict = field(default_factory=dict)
    prefix_caching: bool = False

    def __post_init__(self):
        self.notify_port = free_port()
        self.handshake_port = free_port()
        extra = {
            "backend": "same_host",
            "read_mode": self.read_mode,
            "notify_port": self.notify_port,
            "handshake_port": self.handshake_port,
            "host_ip": "127.0.0.1",
            "tick_interval": 0.005,
            **self.extra,
        }
        config = VllmConfig(
            model_config=ModelConfig(
                model=self.model,
                skip_tokenizer_init=True,
                max_model_len=1024,
                dtype="float32",
                seed=0,
            ),
            cache_config=CacheConfig(
                block_size=BLOCK_SIZE, enable_prefix_caching=self.prefix_caching
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=64,
                max_model_len=1024,
                is_encoder_decoder=False,
                enable_chunked_prefill=True,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="MoRIIOFSMConnector",
                kv_connector_module_path="moriio_fsm.vllm.connector",
                kv_role=self.kv_role,
                engine_id=self.name,
                kv_connector_extra_config=extra,
            ),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        self.config = config
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
        )
        self.worker = MoRIIOFSMConnector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        # vLLM's separated K/V layout [2, num_blocks, block_size, heads, head_size], on whole
        # pages as a large allocation of vLLM's is, so the same-host engine shares them.
        self.kv = {
            name: page_aligned_full((2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), -1.0)
            for name in LAYERS
        }
        self.worker.register_kv_caches(self.kv)
        init_none_hash(lambda value: repr(value).encode())
        self._hasher = get_request_block_hasher(BLOCK_SIZE, lambda v: repr(v).encode("utf-8"))
        self.outputs: dict[str, list[int]] = {}
        self.steps = 0
        self.reported_sending: list[str] = []
        self.reported_recving: list[str] = []
        self.load_errors: set[int] = set()
        self.params_out: dict[str, dict] = {}

    # -- requests ----------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        params: dict | None,
        trace_headers: dict | None = None,
    ) -> Request:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        request = Request(
            request_id,
            list(prompt),
            sampling,
            None,
            block_hasher=self._hasher,
            trace_headers=trace_headers,
        )
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    # -- one engine step, in vLLM's order ------------------------------------------------

    def _forward(self, out) -> dict[str, list[int]]:
        """Write this step's tokens' KV, then sample from the KV each request's blocks hold."""
        sampled = {}
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[index]
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            tokens = request.all_token_ids
            start = computed[req_id]
            for position in range(start, start + count):
                block, slot = blocks[position // BLOCK_SIZE], position % BLOCK_SIZE
                for layer, name in enumerate(LAYERS):
                    self.kv[name][:, block, slot] = token_kv(tokens[position], position, layer)
            end = start + count
            if end >= request.num_prompt_tokens:
                # The next token depends on every cached token's KV: a missing block shows.
                total = 0.0
                for position in range(end):
                    block, slot = blocks[position // BLOCK_SIZE], position % BLOCK_SIZE
                    total += float(self.kv[LAYERS[-1]][1, block, slot, 0, 0]) * (position + 1)
                sampled[req_id] = [1 + int(total) % 997]
            else:
                sampled[req_id] = []
        return sampled

    def step(self) -> None:
        out = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        sampled = self._forward(out) if out.total_num_scheduled_tokens else {}
        for name in LAYERS:
            worker.save_kv_layer(name, self.kv[name], None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(out.finished_req_ids)
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        self.reported_sending += sorted(sending or ())
        self.reported_recving += sorted(recving or ())
        self.load_errors |= errors
        req_ids = list(out.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, invalid_block_ids=errors
            ),
        )
        engine_outputs = self.scheduler.update_from_output(out, output)
        for outputs in engine_outputs.values():
            for item in outputs.outputs:
                self.outputs.setdefault(item.request_id, []).extend(item.new_token_ids)
                if item.finish_reason is not None and item.kv_transfer_params:
                    self.params_out[item.request_id] = item.kv_transfer_params
        self.steps += 1

    def empty(self) -> bool:
        """vLLM's "scheduler empty": no request, every block free, every ref count 0."""
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        return (
            not self.scheduler.requests
            and not self.scheduler.running
            and len(self.scheduler.waiting) == 0
            and pool.get_num_free_blocks() == NUM_BLOCKS - 1
            and all(block.ref_cnt == 0 for block in pool.blocks[1:])
        )

    def close(self) -> None:
        self.worker.shutdown()


def run_until(instances, done, timeout_s: float = 20.0) -> bool:
    """Step every instance until ``done()`` or the time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for instance in instances:
            instance.step()
        if done():
            return True
        time.sleep(0.002)
    return False


def capture_wire(instance: Instance) -> list:
    """Record every control message the instance's worker sends, then send it as before."""
    sent = []
    transport = instance.worker._worker.transport
    original = transport.send

    def send(destination, message):
        sent.append((tuple(destination), message))
        original(destination, message)

    transport.send = send
    return sent


def write_pair_params(tid: str, producer: Instance, consumer: Instance) -> tuple[dict, dict]:
    """What a proxy gives P and D in WRITE mode: each the other's address."""
    to_p = {
        "do_remote_decode": True,
        "transfer_id": tid,
        "remote_host": "127.0.0.1",
        "remote_notify_port": consumer.notify_port,
        "remote_handshake_port": consumer.handshake_port,
    }
    to_d = {
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_host": "127.0.0.1",
        "remote_notify_port": producer.notify_port,
        "remote_handshake_port": producer.handshake_port,
    }
    return to_p, to_d


PROMPT_FOR_METRICS = list(range(300, 340))
