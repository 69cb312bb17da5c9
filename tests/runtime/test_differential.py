"""Differential and property tests: the compiled engine against pytransitions.

Both engines run the same random event sequences (duplicates, reorderings, late,
unknown and malformed events, timer advances) and must agree on every outcome,
state, effect and state hop; every spec invariant is checked after every step; and
an oracle watching only the effects checks the promises D and the allocator rely on.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moriio_fsm.machines import build_machine, build_table
from moriio_fsm.runtime.events import Event, Outcome
from moriio_fsm.runtime.table import TransferTable

IDS = ("tx-a", "tx-b", "tx-c")
CONFIG = {"defer_timeout_s": 5.0, "transfer_timeout_s": 2.0, "max_layers": 6}
# Machines hold no per-transfer state, so one of each serves every example.
MACHINES = {engine: build_machine("write_producer", engine=engine, config=CONFIG)
            for engine in ("compiled", "transitions")}
# "generated" is the compiled machine without invariant checks: the hot path of
# generated per-(state, event) steps; "compiled" with checks takes the general path.
ENGINES = {"generated": ("compiled", False), "compiled": ("compiled", True),
           "transitions": ("transitions", True)}

layer = st.one_of(st.integers(-1, 6), st.just("1"))
event_step = st.one_of(
    st.tuples(st.just("create"), st.fixed_dictionaries({"num_writers": st.integers(1, 3)})),
    st.tuples(st.just("remote_blocks"), st.fixed_dictionaries(
        {"block_ids": st.lists(st.integers(0, 9), max_size=3), "decode_rank": st.integers(0, 1)})),
    st.tuples(st.just("layer_scheduled"), st.fixed_dictionaries({"layer": layer})),
    st.tuples(st.just("seal"), st.just({})),
    st.tuples(st.just("write_completed"), st.fixed_dictionaries({"layer": layer})),
    st.tuples(st.just("write_failed"), st.fixed_dictionaries({"layer": layer, "code": st.just(13)})),
    st.tuples(st.just("request_finished"), st.just({})),
    st.tuples(st.just("abort"), st.just({})),
    st.tuples(st.just("release"), st.just({})),
    st.tuples(st.just("writes_abandoned"), st.just({})),
    st.tuples(st.sampled_from(["defer_timeout", "transfer_timeout"]), st.just({})),
    st.tuples(st.just("remote_blocks"), st.just({"decode_rank": 0})),     # malformed
    st.tuples(st.just("no_such_event"), st.just({})),
)
step = st.one_of(
    st.tuples(st.just("event"), st.sampled_from(IDS), event_step, st.floats(0.0, 0.5)),
    st.tuples(st.just("advance"), st.just(""), st.just(("", {})), st.floats(0.0, 4.0)),
)


class EffectOracle:
    """Checks, from effects alone, what D and the block allocator are promised."""

    def __init__(self):
        self.posted: dict[str, set] = {}
        self.settled: dict[str, set] = {}
        self.verdicts: dict[str, list] = {}
        self.freed: dict[str, int] = {}

    def see(self, ev: Event, result) -> None:
        tid = ev.transfer_id
        posted = self.posted.setdefault(tid, set())
        settled = self.settled.setdefault(tid, set())
        if result.outcome is Outcome.APPLIED and ev.kind in ("write_completed", "write_failed"):
            assert ev.data["layer"] in posted, "a completion was counted for an unposted layer"
            settled.add(ev.data["layer"])
        if result.outcome is Outcome.APPLIED and ev.kind == "writes_abandoned":
            settled.update(posted)
        for effect in result.effects:
            if effect.kind == "post_writes":
                posted.update(effect.data["layers"])
            elif effect.kind in ("send_write_done", "send_write_failed"):
                self.verdicts.setdefault(tid, []).append(effect.kind)
                assert len(self.verdicts[tid]) == 1, f"{tid}: D got two verdicts"
                # Either verdict lets D reuse its blocks: nothing may still land there.
                assert posted <= settled, f"{tid}: {effect.kind} with writes in flight"
                if effect.kind == "send_write_done":
                    assert posted, "write_done without a single write"
            elif effect.kind == "free_blocks":
                self.freed[tid] = self.freed.get(tid, 0) + 1
                assert self.freed[tid] == 1, f"{tid}: blocks handed back twice"
                assert posted <= settled, f"{tid}: blocks freed with writes in flight"
        if result.state in ("failed", "aborted", "expired") and result.outcome is not Outcome.LATE:
            assert self.verdicts.get(tid) == ["send_write_failed"], f"{tid}: failure not told to D"
        if self.freed.get(tid) and not any(e.kind == "free_blocks" for e in result.effects):
            # After the blocks went back nothing may act on the transfer again.
            assert result.outcome in (Outcome.LATE, Outcome.BUFFERED, Outcome.DROPPED), \
                f"{tid}: {ev.kind} acted on a transfer whose blocks were handed back"


def run(engine: str, steps) -> tuple[list, object]:
    machine, checked = ENGINES[engine]
    table = TransferTable(MACHINES[machine], check_invariants=checked, pending_capacity=16,
                          ended_capacity=64)
    oracle = EffectOracle()
    now = 0.0
    trace = []
    for op, tid, (kind, data), dt in steps:
        now += dt
        if op == "advance":
            for ev, result in table.advance(now):
                oracle.see(ev, result)
                trace.append((ev.transfer_id, ev.kind, ev.time, result))
            continue
        ev = Event(tid, kind, now, data)
        result = table.dispatch(ev)
        oracle.see(ev, result)
        trace.append((tid, kind, now, result))
    return trace, table


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=40))
def test_compiled_and_transitions_engines_agree(steps):
    reference_trace, reference = run("transitions", steps)
    for engine in ("compiled", "generated"):
        trace, table = run(engine, steps)
        assert trace == reference_trace, engine
        assert table.stats() == reference.stats(), engine


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=40))
def test_every_transfer_ends_once_the_local_side_is_done(steps):
    """Whatever the peer did or failed to do, seal + request_finished + time ends it."""
    _, table = run("compiled", steps)
    live = [tid for tid in IDS if table.get(tid) is not None]
    now = 1000.0
    for tid in live:
        table.dispatch(Event(tid, "seal", now))
        table.dispatch(Event(tid, "request_finished", now))
    for _ in range(3):
        now += 100.0
        for ev, result in table.advance(now):
            if any(e.kind == "abandon_writes" for e in result.effects):
                # The engine adapter's answer once it tore the writes down.
                table.dispatch(Event(ev.transfer_id, "writes_abandoned", now))
    assert len(table) == 0
    for tid in live:
        assert table.state_of(tid) in {"released", "failed", "aborted", "expired"}


def test_generated_steps_and_general_path_agree_on_a_long_random_run():
    """The generated hot path (no invariant checks) against the checked general path."""
    import random

    rng = random.Random(7)
    kinds = ["layer_scheduled", "write_completed", "write_failed", "seal", "remote_blocks",
             "request_finished", "release", "abort", "create"]
    fast = build_table("write_producer", config=CONFIG)
    checked = build_table("write_producer", config=CONFIG, check_invariants=True)
    assert fast._steps["sealed"] and not checked._steps["sealed"]
    now = 0.0
    for _ in range(20000):
        now += rng.random() * 0.05
        kind = rng.choice(kinds)
        data = {"layer": rng.randrange(6), "code": 13, "num_writers": 1,
                "block_ids": [1, 2], "decode_rank": 0}
        ev = Event(f"tx-{rng.randrange(40)}", kind, now, data)
        assert fast.dispatch(ev) == checked.dispatch(ev)
        if rng.random() < 0.02:
            assert fast.advance(now) == checked.advance(now)
    assert fast.stats() == checked.stats()
