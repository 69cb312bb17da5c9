"""Differential and property tests: the generated steps against pytransitions.

Both executors run the same random event sequences (duplicates, reorderings, late,
unknown, ill-typed and malformed events, handler failures, timer advances), with and
without check mode, and must agree on every outcome, state, effect and state hop; an
oracle watching only the effects checks the promises D and the allocator rely on.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moriio_fsm.machines import build_machine, build_table
from moriio_fsm.runtime.declared import make_event
from moriio_fsm.runtime.events import Event, Outcome
from moriio_fsm.runtime.table import TransferTable

IDS = ("tx-a", "tx-b", "tx-c")
CONFIG = {
    "defer_timeout_s": 5.0,
    "transfer_timeout_s": 2.0,
    "abandon_timeout_s": 1.0,
    "max_layers": 6,
}
MACHINE = build_machine("write_producer", config=CONFIG)
RUNS = {
    "production": ("compiled", False),
    "checked": ("compiled", True),
    "transitions": ("transitions", True),
}
FINAL = {"released", "failed", "aborted", "expired", "quarantined"}

layer = st.one_of(st.integers(-1, 6), st.just("1"), st.none(), st.just(2**80), st.just(True))
text = st.sampled_from(["", "boom"])
event_step = st.one_of(
    st.tuples(
        st.just("prefill_started"), st.fixed_dictionaries({"num_writers": st.integers(0, 3)})
    ),
    st.tuples(
        st.just("remote_blocks"),
        st.fixed_dictionaries(
            {"block_ids": st.lists(st.integers(0, 9), max_size=3), "decode_rank": st.integers(0, 1)}
        ),
    ),
    st.tuples(
        st.just("remote_blocks"),
        st.fixed_dictionaries(  # ill-typed: rejected
            {"block_ids": st.sampled_from([None, "1,2", 7]), "decode_rank": st.just(0)}
        ),
    ),
    st.tuples(st.just("layer_scheduled"), st.fixed_dictionaries({"layer": layer})),
    st.tuples(st.just("seal"), st.just({})),
    st.tuples(st.just("layer_write_completed"), st.fixed_dictionaries({"layer": layer})),
    st.tuples(
        st.just("layer_write_failed"), st.fixed_dictionaries({"layer": layer, "code": st.just(13)})
    ),
    st.tuples(st.just("post_failed"), st.fixed_dictionaries({"layer": layer, "error": text})),
    st.tuples(st.just("request_finished"), st.just({})),
    st.tuples(st.just("abort"), st.just({})),
    st.tuples(st.just("release"), st.just({})),
    st.tuples(st.just("writes_abandoned"), st.just({})),
    st.tuples(st.just("abandon_failed"), st.fixed_dictionaries({"error": text})),
    st.tuples(st.just("notify_failed"), st.fixed_dictionaries({"error": text})),
    st.tuples(
        st.sampled_from(["defer_timeout", "transfer_timeout", "abandon_timeout"]), st.just({})
    ),
    st.tuples(st.just(""), st.just({})),  # a plain Event: no kind at all
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
        self.blocks_left: dict[str, int] = {}

    def see(self, ev: Event, result) -> None:
        tid = ev.transfer_id
        posted = self.posted.setdefault(tid, set())
        settled = self.settled.setdefault(tid, set())
        if result.outcome is Outcome.APPLIED and ev.kind in (
            "layer_write_completed",
            "layer_write_failed",
            "post_failed",
        ):
            assert ev.layer in posted, "a completion was counted for an unposted layer"
            settled.add(ev.layer)
        if result.outcome is Outcome.APPLIED and ev.kind == "writes_abandoned":
            settled.update(posted)
        for effect in result.effects:
            if effect.kind == "post_write":
                assert effect.layer not in posted, f"{tid}: layer {effect.layer} posted twice"
                posted.add(effect.layer)
            elif effect.kind in ("send_write_done", "send_write_failed"):
                verdicts = self.verdicts.setdefault(tid, [])
                if verdicts and effect == verdicts[0]:
                    continue  # D's release asked again: the same verdict, repeated
                verdicts.append(effect)
                assert len(verdicts) == 1, f"{tid}: D got two different verdicts"
                stopped = effect.kind == "send_write_done" or effect.writes_stopped
                # A verdict that says the writes stopped lets D reuse its blocks.
                assert not stopped or posted <= settled, (
                    f"{tid}: {effect.kind} with writes in flight"
                )
                if not stopped:
                    assert not posted <= settled and result.state == "quarantined"
                if effect.kind == "send_write_done":
                    assert posted, "write_done without a single write"
            elif effect.kind in ("free_blocks", "quarantine_blocks"):
                self.blocks_left[tid] = self.blocks_left.get(tid, 0) + 1
                assert self.blocks_left[tid] == 1, f"{tid}: blocks handed back twice"
                if effect.kind == "free_blocks":
                    assert posted <= settled, f"{tid}: blocks freed with writes in flight"
        if (
            result.state in FINAL
            and result.outcome is not Outcome.LATE
            and result.state != "released"
        ):
            [verdict] = self.verdicts.get(tid, [None])
            assert verdict is not None and verdict.kind == "send_write_failed", (
                f"{tid}: ended {result.state} without telling D"
            )
        if self.blocks_left.get(tid) and not any(
            e.kind in ("free_blocks", "quarantine_blocks") for e in result.effects
        ):
            # After the blocks left nothing may act on the transfer again.
            assert result.outcome in (
                Outcome.LATE,
                Outcome.BUFFERED,
                Outcome.DROPPED,
                Outcome.REJECTED,
            ), f"{tid}: {ev.kind} acted on a transfer whose blocks were handed back"


def build(kind: str, tid: str, now: float, data: dict) -> Event:
    return Event(tid, now) if not kind else make_event(kind, tid, now, data)


def run(name: str, steps) -> tuple[list, TransferTable]:
    executor, checked = RUNS[name]
    table = TransferTable(
        MACHINE, executor=executor, check_invariants=checked, pending_capacity=16, ended_capacity=64
    )
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
        ev = build(kind, tid, now, data)
        result = table.dispatch(ev)
        oracle.see(ev, result)
        trace.append((tid, kind, now, result))
    return trace, table


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=40))
def test_generated_steps_and_pytransitions_agree_with_and_without_checks(steps):
    reference_trace, reference = run("transitions", steps)
    for name in ("checked", "production"):
        trace, table = run(name, steps)
        assert trace == reference_trace, name
        assert table.stats() == reference.stats(), name
        assert table.audit() == [], name


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=40), st.booleans())
def test_every_transfer_ends_once_the_local_side_is_done(steps, adapter_answers):
    """Whatever the peer did or failed to do, seal + request_finished + time ends it,
    whether or not the engine adapter ever confirms a teardown."""
    _, table = run("checked", steps)
    live = [tid for tid in IDS if table.get(tid) is not None]
    now = 1000.0
    for tid in live:
        table.dispatch(make_event("seal", tid, now))
        table.dispatch(make_event("request_finished", tid, now))
    for _ in range(4):
        now += 100.0
        for ev, result in table.advance(now):
            if adapter_answers and any(e.kind == "abandon_writes" for e in result.effects):
                table.dispatch(make_event("writes_abandoned", ev.transfer_id, now))
    assert len(table) == 0
    for tid in live:
        assert table.state_of(tid) in FINAL
        if adapter_answers:
            assert table.state_of(tid) != "quarantined" or table.stats()["anomalies"]


def test_production_and_check_mode_agree_on_a_long_random_run():
    import random

    rng = random.Random(7)
    kinds = [
        "layer_scheduled",
        "layer_write_completed",
        "layer_write_failed",
        "seal",
        "remote_blocks",
        "request_finished",
        "release",
        "abort",
        "prefill_started",
        "post_failed",
        "writes_abandoned",
        "notify_failed",
    ]
    fast = build_table("write_producer", config=CONFIG)
    checked = build_table("write_producer", config=CONFIG, check_invariants=True)
    assert fast.generated.source.count("verify(") == 0 < checked.generated.source.count("verify(")
    now = 0.0
    for _ in range(20000):
        now += rng.random() * 0.05
        kind = rng.choice(kinds)
        data = {
            "layer": rng.randrange(6),
            "code": 13,
            "num_writers": 1,
            "error": "",
            "block_ids": [1, 2],
            "decode_rank": 0,
        }
        fields = MACHINE.spec.events[kind].payload
        ev = make_event(
            kind, f"tx-{rng.randrange(40)}", now, {k: data[k] for k in fields if k in data}
        )
        assert fast.dispatch(ev) == checked.dispatch(ev)
        if rng.random() < 0.02:
            assert fast.advance(now) == checked.advance(now)
    assert fast.stats() == checked.stats()
