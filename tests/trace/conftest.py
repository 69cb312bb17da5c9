"""Traces the trace tests share: the scenarios', a fault-free joint P/D run, and a stuck transfer.

The stuck one: two P ranks write into one D rank; D's remote_blocks never reaches P1,
so P1's transfer expires, and its write_failed to D is lost too: D waits for a verdict
that will never come (until its own timeout, after the trace ends).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moriio_fsm.runtime.declared import events
from moriio_fsm.scenarios import run as run_demo
from moriio_fsm.sim.pd import PD, Layout, link
from moriio_fsm.trace import TraceRecorder


def lifecycle(table, tid: str, layers: int = 2, now: float = 0.0) -> None:
    """One clean WRITE producer transfer of ``layers`` layers (3 + 2 * layers events)."""
    d = table.dispatch
    d(events.prefill_started(tid, now, num_writers=1))
    d(events.remote_blocks(tid, now, block_ids=[1, 2], decode_rank=0))
    for layer in range(layers):
        d(events.layer_scheduled(tid, now, layer))
    d(events.seal(tid, now))
    for layer in range(layers):
        d(events.layer_write_completed(tid, now, layer))
    d(events.request_finished(tid, now))


@pytest.fixture
def demo_trace(tmp_path) -> Path:
    path = tmp_path / "demo.jsonl"
    recorder = TraceRecorder("demo", file=path)
    run_demo(recorder=recorder)
    recorder.close()
    return path


def traced_pd(folder: Path, layout: Layout, seed: int = 3, drop=None):
    """A PD world whose every node writes ``<node>.jsonl`` into ``folder``; ``drop(sender,
    receiver, kind)`` True loses that message."""
    recorders = {}
    holder = {}

    def recorder_for(node: str):
        recorders[node] = TraceRecorder(
            node, file=folder / f"{node}.jsonl", link=link, virtual_time=True
        )
        return recorders[node]

    pd = holder["pd"] = PD(seed, layout, recorders=recorder_for)
    if drop is not None:
        send = pd.world.send

        def lossy(sender, receiver, kind, tid, data):
            if not drop(sender, receiver, kind):
                send(sender, receiver, kind, tid, data)

        pd.world.send = lossy
    return pd, recorders


def close_all(recorders) -> list[Path]:
    for recorder in recorders.values():
        recorder.close()
    return sorted(Path(r.writer.path) for r in recorders.values())


@pytest.fixture
def stuck_trace(tmp_path) -> list[Path]:
    pd, recorders = traced_pd(
        tmp_path,
        Layout(p=2, d=1),
        seed=7,
        drop=lambda s, r, kind: (
            (r, kind) == ("P1", "remote_blocks") or (s, kind) == ("P1", "write_failed")
        ),
    )
    pd.start_write("tx-0")
    pd.world.run(until=8.0, tick=0.05)
    return close_all(recorders)
