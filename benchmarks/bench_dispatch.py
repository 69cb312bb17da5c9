"""Benchmark: one full WRITE-producer lifecycle through the runtime vs. a baseline.

Measures, in one run, the per-lifecycle time of (a) the compiled runtime, (b) a
hand-written baseline keeping upstream MoRIIO's bookkeeping step for step (dicts, sets
of layer names, counters, deferred tasks, a terminal LRU, and upstream's lock
acquisitions per step), and (c) the
pytransitions reference engine; then the memory per live transfer with 10,000
transfers alive. Prints medians of repeated rounds and the three ratio lines last.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
import tracemalloc
import uuid
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

from moriio_fsm.machines import build_table
from moriio_fsm.runtime.events import Event

NUM_LAYERS = 64


@dataclass
class WriteTask:
    """One queued layer write, with the fields upstream's task carries."""

    request_id: str
    transfer_id: str
    dst_engine_id: str
    local_block_ids: list
    layer_name: str
    event: object
    remote_notify_port: int
    remote_ip: str
    enqueue_time: float


@dataclass
class RemoteAllocInfo:
    """Upstream's per-transfer record of D's allocation and of write progress."""

    block_ids: list
    decode_dp_rank: int = 0
    writes_done: int = 0
    writes_expected: int | None = None
    completion_notified: bool = False
    completion_request_id: str | None = None
    completion_remote_notify_port: int | None = None
    completion_remote_ip: str | None = None
    transfer_statuses: list = field(default_factory=list)


class UpstreamStyleProducer:
    """The bookkeeping upstream's WRITE producer keeps, step for step (the baseline).

    Same structures and the same lock acquisitions per step as upstream's writer and
    wrapper (scheduled-layer name sets, scheduled/sealed counts, the remote
    allocation dict, deferred tasks, done lists, the 4096-id terminal LRU, a deadline
    dict), with the queue hand-off replaced by a plain list and no RDMA call, so only
    bookkeeping is timed. Each hook is one method the benchmark calls.
    """

    def __init__(self):
        self.state_lock = threading.Lock()      # upstream: the writer's state lock
        self.wrapper_lock = threading.Lock()    # upstream: the wrapper's lock
        self.scheduled_writes: dict[str, int] = defaultdict(int)
        self.scheduled_layers: dict[str, set[str]] = defaultdict(set)
        self.sealed_writes: dict[str, int] = {}
        self.remote_alloc: dict[str, RemoteAllocInfo] = {}
        self.deferred: list[WriteTask] = []
        self.queue: list[WriteTask] = []
        self.done_req_ids: list[str] = []
        self.done_sending: list[str] = []
        self.request_done: set[str] = set()
        self.deadlines: dict[str, float] = {}
        self.terminal: OrderedDict[str, None] = OrderedDict()

    # scheduler side ------------------------------------------------------------------
    def start(self, tid, now):
        with self.wrapper_lock:
            self.deadlines[tid] = now + 60.0

    # notify listener: D's remote_blocks ------------------------------------------------
    def remote_blocks(self, tid, block_ids, rank):
        with self.wrapper_lock:
            if tid in self.terminal:
                return
            if tid not in self.remote_alloc:
                self.remote_alloc[tid] = RemoteAllocInfo(block_ids=block_ids, decode_dp_rank=rank)

    # forward thread: save_kv_layer ------------------------------------------------------
    def schedule_layer(self, task: WriteTask):
        with self.state_lock:
            if task.layer_name in self.scheduled_layers[task.transfer_id]:
                return False
            self.scheduled_layers[task.transfer_id].add(task.layer_name)
            self.scheduled_writes[task.transfer_id] += 1
        self.queue.append(task)
        return True

    # write thread: take a task, post it (the post itself is not timed) -------------------
    def run_queued(self):
        for task in self.queue:
            with self.wrapper_lock:
                if task.transfer_id in self.terminal:
                    continue
            info = self.remote_alloc.get(task.transfer_id)
            if info is None:
                self.deferred.append(task)
                continue
            with self.state_lock:
                info.completion_request_id = task.request_id
                info.completion_remote_notify_port = task.remote_notify_port
                info.completion_remote_ip = task.remote_ip
                if task.transfer_id in self.sealed_writes:
                    info.writes_expected = self.sealed_writes[task.transfer_id]
            with self.state_lock:
                info.transfer_statuses.append(task.layer_name)
        self.queue.clear()

    # forward thread: wait_for_save seals ----------------------------------------------
    def seal(self, tid):
        with self.state_lock:
            for transfer_id, count in self.scheduled_writes.items():
                if transfer_id in self.sealed_writes:
                    continue
                self.sealed_writes[transfer_id] = count
                info = self.remote_alloc.get(transfer_id)
                if info is not None:
                    info.writes_expected = count

    # write thread: one layer's write finished ------------------------------------------
    def write_completed(self, tid):
        info = self.remote_alloc.get(tid)
        if info is None:
            return
        with self.state_lock:
            info.writes_done += 1
        self._finalize_if_complete(tid, info)

    def _finalize_if_complete(self, tid, info):
        with self.state_lock:
            expected = info.writes_expected
            if expected is None or info.writes_done < expected or info.completion_notified:
                return
            info.transfer_statuses.clear()
            info.completion_notified = True
        with self.wrapper_lock:
            self.done_req_ids.append(tid)
        self._maybe_release(tid)

    def request_finished(self, tid):
        with self.wrapper_lock:
            self.request_done.add(tid)
        self._maybe_release(tid)

    def _maybe_release(self, tid):
        info = self.remote_alloc.get(tid)
        if info is not None and info.completion_notified and tid in self.request_done:
            self.done_sending.append(tid)
            self._mark_terminal(tid)

    # notify listener: D's release ------------------------------------------------------
    def release(self, tid):
        with self.wrapper_lock:
            if tid in self.terminal:
                return
        self._mark_terminal(tid)

    def _mark_terminal(self, tid):
        with self.wrapper_lock:
            self.remote_alloc.pop(tid, None)
            self.deadlines.pop(tid, None)
            self.request_done.discard(tid)
            self.terminal[tid] = None
            if len(self.terminal) > 4096:
                self.terminal.popitem(last=False)
        with self.state_lock:
            self.scheduled_writes.pop(tid, None)
            self.scheduled_layers.pop(tid, None)
            self.sealed_writes.pop(tid, None)


LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
BLOCK_IDS = list(range(16))


def lifecycle_runtime(table, tid, now):
    d = table.dispatch
    d(Event(tid, "create", now, {"num_writers": 1}))
    d(Event(tid, "remote_blocks", now, {"block_ids": BLOCK_IDS, "decode_rank": 0}))
    for layer in range(NUM_LAYERS):
        d(Event(tid, "layer_scheduled", now, {"layer": layer}))
    d(Event(tid, "seal", now))
    for layer in range(NUM_LAYERS):
        d(Event(tid, "write_completed", now, {"layer": layer}))
    d(Event(tid, "request_finished", now))
    d(Event(tid, "release", now))


def lifecycle_baseline(book, tid, now):
    book.start(tid, now)
    book.remote_blocks(tid, BLOCK_IDS, 0)
    for name in LAYER_NAMES:
        book.schedule_layer(WriteTask("req-1", tid, "decode-0", BLOCK_IDS, name, None,
                                      61000, "127.0.0.1", now))
    book.run_queued()
    book.seal(tid)
    for _ in range(NUM_LAYERS):
        book.write_completed(tid)
    book.request_finished(tid)
    book.release(tid)
    book.done_req_ids.clear()
    book.done_sending.clear()


def time_round(run, target, per_round):
    ids = [f"tx-{uuid.uuid4()}" for _ in range(per_round)]
    start = time.perf_counter()
    for i, tid in enumerate(ids):
        run(target, tid, float(i))
    return (time.perf_counter() - start) / per_round


def bytes_per_live_transfer(count: int) -> int:
    table = build_table("write_producer")
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(count):
        tid = f"tx-{uuid.uuid4()}"               # the id is counted: the table keeps it
        table.dispatch(Event(tid, "create", 0.0, {"num_writers": 1}))
        table.dispatch(Event(tid, "remote_blocks", 0.0,
                             {"block_ids": list(range(16)), "decode_rank": 0}))
        for layer in range(NUM_LAYERS):
            table.dispatch(Event(tid, "layer_scheduled", 0.0, {"layer": layer}))
        table.dispatch(Event(tid, "seal", 0.0))
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(table) == count
    return (after - before) // count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--live", type=int, default=10_000)
    args = parser.parse_args()

    compiled = build_table("write_producer", engine="compiled")
    reference = build_table("write_producer", engine="transitions")
    baseline = UpstreamStyleProducer()
    samples = {"compiled": [], "baseline": [], "transitions": []}
    for _ in range(args.rounds):
        # Interleave the three in every round so machine noise hits them alike.
        samples["compiled"].append(time_round(lifecycle_runtime, compiled, args.per_round))
        samples["baseline"].append(time_round(lifecycle_baseline, baseline, args.per_round))
        samples["transitions"].append(
            time_round(lifecycle_runtime, reference, max(1, args.per_round // 10)))
    med = {k: statistics.median(v) for k, v in samples.items()}
    for name, value in med.items():
        print(f"{name:12s} median {value * 1e6:9.1f} us per lifecycle "
              f"({2 * NUM_LAYERS + 5} events)")
    live_bytes = bytes_per_live_transfer(args.live)
    print(f"live transfers measured: {args.live} (sealed, 64 layers posted, 16 block ids)")
    print(f"lifecycle_vs_baseline: {med['compiled'] / med['baseline']:.2f}")
    print(f"transitions_vs_compiled: {med['transitions'] / med['compiled']:.1f}")
    print(f"bytes_per_live_transfer: {live_bytes}")


if __name__ == "__main__":
    main()
