"""Benchmark: one full WRITE-producer lifecycle through the runtime vs. two baselines.

Measures, in one run, the per-lifecycle time of (a) the compiled runtime, (b) a
hand-written baseline keeping upstream MoRIIO's bookkeeping step for step (dicts, sets
of layer names, counters, deferred tasks, a terminal LRU, and upstream's lock
acquisitions per step), (c) a lean hand-written producer with one lock per call,
bitmaps and counters and the same outputs as the runtime, and (d) the pytransitions
reference executor; then the memory per live transfer with 10,000 transfers alive, and
the cost of one junk peer event during a flood of 1,000,000 unknown ids against one
normal dispatch. Prints medians of repeated rounds and the ratio lines last.
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
from moriio_fsm.runtime.declared import events

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
        self.state_lock = threading.Lock()  # upstream: the writer's state lock
        self.wrapper_lock = threading.Lock()  # upstream: the wrapper's lock
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


class _LeanTransfer:
    __slots__ = (
        "num_writers",
        "blocks",
        "rank",
        "scheduled",
        "posted",
        "settled",
        "completed",
        "failed",
        "expected",
        "finished",
        "done_sent",
        "freed",
        "deadline",
    )

    def __init__(self, num_writers: int, deadline: float):
        self.num_writers = num_writers
        self.blocks = None
        self.rank = -1
        self.scheduled = self.posted = self.settled = 0
        self.completed = self.failed = 0
        self.expected = -1
        self.finished = False
        self.done_sent = False
        self.freed = False
        self.deadline = deadline


class LeanProducer:
    """The WRITE producer's success path written by hand as tightly as it goes: one lock
    per call, one slotted record per transfer with bitmaps and counters, a bounded set
    of ended ids, and the same outputs the runtime emits (a post per layer, write_done
    once, the blocks freed once). Like the runtime it refuses a layer index that is not
    an integer in range instead of crashing on it. It keeps a single deadline per
    transfer and no timer heap, counts nothing and cannot roll a step back, so it does
    less than the runtime; it is the floor to compare against."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live: dict[str, _LeanTransfer] = {}
        self.ended: dict[str, None] = {}

    def create(self, tid, num_writers, now):
        with self.lock:
            if tid in self.live or tid in self.ended:
                return []
            self.live[tid] = _LeanTransfer(num_writers, now + 60.0)
            return []

    def remote_blocks(self, tid, block_ids, rank, now):
        with self.lock:
            tx = self.live.get(tid)
            if tx is None or tx.blocks is not None:
                return []
            tx.blocks, tx.rank = block_ids, rank
            waiting = tx.scheduled & ~tx.posted
            tx.posted |= waiting
            out = []
            while waiting:
                low = waiting & -waiting
                out.append(("post_write", tid, low.bit_length() - 1, block_ids, rank))
                waiting ^= low
            return out

    def layer_scheduled(self, tid, layer, now):
        with self.lock:
            tx = self.live.get(tid)
            if tx is None or type(layer) is not int or not 0 <= layer < 4096:
                return []
            bit = 1 << layer
            if tx.scheduled & bit:
                return []
            tx.scheduled |= bit
            tx.deadline = now + 30.0
            if tx.blocks is None:
                return []
            tx.posted |= bit
            return [("post_write", tid, layer, tx.blocks, tx.rank)]

    def seal(self, tid, now):
        with self.lock:
            tx = self.live.get(tid)
            if tx is not None and tx.expected < 0:
                tx.expected = tx.scheduled.bit_count()
            return []

    def write_completed(self, tid, layer, now):
        with self.lock:
            tx = self.live.get(tid)
            if tx is None or type(layer) is not int or not 0 <= layer < 4096:
                return []
            bit = 1 << layer
            if not (tx.posted & ~tx.settled) & bit:
                return []
            tx.settled |= bit
            tx.completed += 1
            tx.deadline = now + 30.0
            if tx.completed == tx.expected and not tx.done_sent:
                tx.done_sent = True
                return [("send_write_done", tid, tx.num_writers, tx.rank)]
            return []

    def request_finished(self, tid, now):
        with self.lock:
            tx = self.live.get(tid)
            if tx is None:
                return []
            tx.finished = True
            if tx.done_sent and not tx.freed:
                tx.freed = True
                del self.live[tid]
                self.ended[tid] = None
                if len(self.ended) > 65536:
                    del self.ended[next(iter(self.ended))]
                return [("free_blocks", tid)]
            return []

    def release(self, tid, now):
        with self.lock:
            return []


LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
BLOCK_IDS = list(range(16))


def lifecycle_runtime(table, tid, now):
    d = table.dispatch
    d(events.prefill_started(tid, now, num_writers=1))
    d(events.remote_blocks(tid, now, block_ids=BLOCK_IDS, decode_rank=0))
    layer_scheduled, write_completed = events.layer_scheduled, events.layer_write_completed
    for layer in range(NUM_LAYERS):
        d(layer_scheduled(tid, now, layer))
    d(events.seal(tid, now))
    for layer in range(NUM_LAYERS):
        d(write_completed(tid, now, layer))
    d(events.request_finished(tid, now))
    d(events.release(tid, now))


def lifecycle_baseline(book, tid, now):
    book.start(tid, now)
    book.remote_blocks(tid, BLOCK_IDS, 0)
    for name in LAYER_NAMES:
        book.schedule_layer(
            WriteTask("req-1", tid, "decode-0", BLOCK_IDS, name, None, 61000, "127.0.0.1", now)
        )
    book.run_queued()
    book.seal(tid)
    for _ in range(NUM_LAYERS):
        book.write_completed(tid)
    book.request_finished(tid)
    book.release(tid)
    book.done_req_ids.clear()
    book.done_sending.clear()


def lifecycle_lean(book, tid, now):
    book.create(tid, 1, now)
    book.remote_blocks(tid, BLOCK_IDS, 0, now)
    for layer in range(NUM_LAYERS):
        book.layer_scheduled(tid, layer, now)
    book.seal(tid, now)
    for layer in range(NUM_LAYERS):
        book.write_completed(tid, layer, now)
    book.request_finished(tid, now)
    book.release(tid, now)


def junk_flood_cost(flood: int) -> tuple[float, float, bool]:
    """Per-event time of a remote event for an unknown id while ``flood`` junk ids stream
    in from one peer, the per-event time of ordinary dispatches, and whether a real
    peer's early remote_blocks sent in the middle of the flood survived it."""
    table = build_table("write_producer")
    junk = [events.release(f"junk-{i}", 0.0, source="flooder") for i in range(flood)]
    real = events.remote_blocks("tx-real", 0.0, BLOCK_IDS, 0, source="decoder")
    d = table.dispatch
    half = flood // 2
    start = time.perf_counter()
    for ev in junk[:half]:
        d(ev)
    d(real)
    for ev in junk[half:]:
        d(ev)
    junk_time = (time.perf_counter() - start) / (flood + 1)
    table.dispatch(events.prefill_started("tx-real", 1.0, num_writers=1))
    survived = table.get("tx-real").has_allocation
    normal = build_table("write_producer")
    ids = [f"tx-{i}" for i in range(2000)]
    start = time.perf_counter()
    count = 0
    for tid in ids:
        lifecycle_runtime(normal, tid, 0.0)
        count += 2 * NUM_LAYERS + 5
    normal_time = (time.perf_counter() - start) / count
    return junk_time, normal_time, survived


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
    for _i in range(count):
        tid = f"tx-{uuid.uuid4()}"  # the id is counted: the table keeps it
        table.dispatch(events.prefill_started(tid, 0.0, num_writers=1))
        table.dispatch(events.remote_blocks(tid, 0.0, block_ids=list(range(16)), decode_rank=0))
        for layer in range(NUM_LAYERS):
            table.dispatch(events.layer_scheduled(tid, 0.0, layer=layer))
        table.dispatch(events.seal(tid, 0.0))
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
    parser.add_argument("--flood", type=int, default=1_000_000)
    args = parser.parse_args()

    compiled = build_table("write_producer", executor="compiled")
    reference = build_table("write_producer", executor="transitions")
    baseline = UpstreamStyleProducer()
    lean = LeanProducer()
    samples = {"compiled": [], "upstream": [], "lean": [], "transitions": []}
    for _ in range(args.rounds):
        # Interleave them in every round so machine noise hits them alike.
        samples["compiled"].append(time_round(lifecycle_runtime, compiled, args.per_round))
        samples["upstream"].append(time_round(lifecycle_baseline, baseline, args.per_round))
        samples["lean"].append(time_round(lifecycle_lean, lean, args.per_round))
        samples["transitions"].append(
            time_round(lifecycle_runtime, reference, max(1, args.per_round // 10))
        )
    med = {k: statistics.median(v) for k, v in samples.items()}
    for name, value in med.items():
        print(
            f"{name:12s} median {value * 1e6:9.1f} us per lifecycle ({2 * NUM_LAYERS + 5} events)"
        )
    live_bytes = bytes_per_live_transfer(args.live)
    print(f"live transfers measured: {args.live} (sealed, 64 layers posted, 16 block ids)")
    junk, normal, survived = junk_flood_cost(args.flood)
    print(
        f"flood of {args.flood} junk ids from one peer: {junk * 1e9:.0f} ns per junk event, "
        f"{normal * 1e9:.0f} ns per ordinary dispatch; the real peer's early remote_blocks "
        f"{'survived' if survived else 'WAS LOST'}"
    )
    print(f"lifecycle_vs_baseline: {med['compiled'] / med['upstream']:.2f}")
    print(f"lifecycle_vs_lean_baseline: {med['compiled'] / med['lean']:.2f}")
    print(f"transitions_vs_compiled: {med['transitions'] / med['compiled']:.1f}")
    print(f"bytes_per_live_transfer: {live_bytes}")
    print(f"junk_vs_dispatch: {junk / normal:.2f}")


if __name__ == "__main__":
    main()
