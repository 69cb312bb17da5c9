"""Bugs planted in copies of the specs and bindings, and the checker finding each.

A guard removed, a timer dropped, an effect emitted twice (and a few more), each in a
copy: the shipped spec is never touched. Where a planted bug would also break one of the
spec's own invariants, a second test strips the invariants from the copy, to show that
the effect rules, which never read the context, catch it by themselves. Every
counterexample must end in the step that broke the rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moriio_fsm.check import Bounds, check_machine, check_pair
from moriio_fsm.check.report import steps_of
from moriio_fsm.check.single import Dispatch
from moriio_fsm.lang.loader import load_spec, parse_spec
from moriio_fsm.lang.validate import validate_spec
from moriio_fsm.machines import load_bindings, resolve_config, spec_path
from moriio_fsm.runtime.declared import emits
from moriio_fsm.runtime.machine import Machine

SMALL = Bounds(layers=1, peer_events=3)


def planted(tmp_path: Path, name: str, old: str, new: str, *, invariants: bool = True) -> Path:
    """A copy of spec ``name`` with ``old`` replaced by ``new`` (and, unless
    ``invariants``, without its invariants)."""
    text = spec_path(name).read_text()
    assert old in text, f"the planted text is no longer in {name}.yaml: {old!r}"
    text = text.replace(old, new)
    if not invariants:
        text = text[: text.index("\ninvariants:")] + "\n"
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def machine(spec: str | Path, *functions, name: str | None = None) -> Machine:
    loaded = load_spec(spec if isinstance(spec, Path) else spec_path(spec))
    bindings = load_bindings(loaded)
    return Machine(
        loaded,
        bindings.replaced(*functions) if functions else bindings,
        resolve_config(loaded, None),
    )


def without_invariants(tmp_path: Path, name: str) -> Path:
    text = spec_path(name).read_text()
    path = tmp_path / f"{name}.yaml"
    path.write_text(text[: text.index("\ninvariants:")] + "\n")
    return path


def last_event(finding) -> str:
    dispatches = [s for s in steps_of(finding.path) if isinstance(s, Dispatch)]
    return dispatches[-1].event.kind


# -- a guard removed ----------------------------------------------------------------------


def nothing_in_flight(tx, ev) -> bool:  # planted: P tells D before its writes stopped
    return True


def test_a_producer_that_tells_d_before_its_writes_stopped_is_caught(tmp_path):
    result = check_machine(machine("write_producer", nothing_in_flight), SMALL)
    # Check mode rolls the step back at the broken invariant, before its effects count.
    assert set(result.findings) == {"invariant:write_failed_only_when_quiet"}
    assert last_event(result.findings["invariant:write_failed_only_when_quiet"]) in (
        "layer_write_failed",
        "post_failed",
        "request_finished",
        "abort",
        "release",
        "defer_timeout",
    )


def test_the_effect_rules_alone_catch_it_when_the_spec_lost_its_invariants(tmp_path):
    bare = without_invariants(tmp_path, "write_producer")
    result = check_machine(machine(bare, nothing_in_flight), SMALL)
    assert not any(rule.startswith("invariant:") for rule in result.findings)
    finding = result.findings["peer_told_only_when_quiet"]
    assert "send_write_failed" in finding.message
    # The shortest way there: created, D's blocks, one layer posted, then a failure that
    # sends P draining while the write is still in flight.
    assert len(steps_of(finding.path)) <= 5
    # And once the request finished, P hands its blocks back under that write.
    assert (
        "free_blocks while layer(s) 0 may still be in flight"
        in result.findings["no_handback_in_flight"].message
    )


def all_writes_succeeded(tx, ev) -> bool:  # planted: write_done without waiting
    return tx.has_allocation


def test_write_done_before_the_sealed_writes_completed_is_caught(tmp_path):
    bare = without_invariants(tmp_path, "write_producer")
    result = check_machine(machine(bare, all_writes_succeeded), SMALL)
    finding = result.findings["write_done_after_sealed_writes"]
    assert "sealed layer(s) 0 not completed" in finding.message
    assert last_event(finding) == "seal"


def tell_release(tx, ev, out) -> None:  # planted: D tells P only after its own timeout
    if tx.release_sent == 0 and tx.end_reason == "timeout":
        tx.release_sent = 1
        out.append(emits.send_release(tx.transfer_id, reason=tx.end_reason))


def test_a_consumer_that_ends_without_telling_p_is_caught():
    result = check_machine(machine("write_consumer", tell_release), SMALL)
    finding = result.findings["failure_tells_peer"]
    assert "without success and without telling the peer" in finding.message


def test_a_guard_removed_from_the_spec_copy_frees_blocks_vllm_still_owns(tmp_path):
    path = planted(
        tmp_path,
        "write_producer",
        "  - {source: completed, dest: released, guard: local_request_finished, "
        "actions: [free_blocks],",
        "  - {source: completed, dest: released, actions: [free_blocks],",
    )
    result = check_machine(machine(path), SMALL)
    finding = result.findings["invariant:blocks_freed_only_when_owned"]
    assert last_event(finding) == "layer_write_completed"  # write_done, then freed at once


# -- a timer dropped ------------------------------------------------------------------------

SAFETY_TIMER = """  safety:
    states: [stopping]
    duration: safety_timeout_s
    event: safety_timeout
"""


def test_a_consumer_without_its_safety_timer_can_wait_forever(tmp_path):
    path = planted(tmp_path, "write_consumer", SAFETY_TIMER, "")
    # The static check is fooled: the request ending looks like a way out of 'stopping'.
    assert validate_spec(load_spec(path)) == []
    result = check_machine(machine(path), SMALL)
    finding = result.findings["ends_without_peer"]
    assert "'stopping'" in finding.message and "no timer armed" in finding.message
    assert set(result.findings) == {"ends_without_peer"}


def test_a_reader_without_its_abandon_timer_waits_for_a_teardown_forever(tmp_path):
    path = planted(
        tmp_path,
        "read_consumer",
        """  abandon:
    states: [abandoning]
    duration: abandon_timeout_s
    event: abandon_timeout
""",
        "",
    )
    result = check_machine(machine(path), SMALL)
    assert "'abandoning'" in result.findings["ends_without_peer"].message


# -- an effect emitted twice ----------------------------------------------------------------


def free_blocks(tx, ev, out) -> None:  # planted: counted once, emitted twice
    tx.blocks_freed += 1
    out.append(emits.free_blocks(tx.transfer_id, reason="completed"))
    out.append(emits.free_blocks(tx.transfer_id, reason="completed"))


def tell_write_done(tx, ev, out) -> None:  # planted: counted once, emitted twice
    tx.write_done_sent += 1
    for _ in range(2):
        out.append(
            emits.send_write_done(
                tx.transfer_id, num_writers=tx.num_writers, decode_rank=tx.decode_rank
            )
        )


def test_blocks_freed_twice_are_caught_though_every_invariant_holds():
    result = check_machine(machine("write_producer", free_blocks), SMALL)
    assert set(result.findings) == {"blocks_leave_once"}
    assert (
        "free_blocks after the blocks had already left"
        in result.findings["blocks_leave_once"].message
    )


def test_write_done_sent_twice_is_caught():
    result = check_machine(machine("write_producer", tell_write_done), SMALL)
    assert "write_done_once" in result.findings
    assert last_event(result.findings["write_done_once"]) == "layer_write_completed"


WRITE_DONE_AGAIN = (
    "  - {event: request_finished, source: [scheduling, sealed, completed, draining, abandoning, closing],\n"
    "     internal: true, actions: [mark_request_finished]}",
    "  - {event: request_finished, source: completed, internal: true,\n"
    "     actions: [mark_request_finished, tell_write_done], emits: [send_write_done]}\n"
    "  - {event: request_finished, source: [scheduling, sealed, draining, abandoning, closing],\n"
    "     internal: true, actions: [mark_request_finished]}",
)


def test_a_spec_copy_that_sends_write_done_again_is_caught_by_invariant_and_effect_rule(tmp_path):
    """(The validator already makes a double free impossible in a spec: an emit without
    on_failure may only lead into a final state, and only one row can.)"""
    result = check_machine(machine(planted(tmp_path, "write_producer", *WRITE_DONE_AGAIN)), SMALL)
    assert "invariant:write_done_at_most_once" in result.findings
    bare = planted(tmp_path, "write_producer", *WRITE_DONE_AGAIN, invariants=False)
    finding = check_machine(machine(bare), SMALL).findings["write_done_once"]
    assert last_event(finding) == "request_finished"


# -- bugs only the pair shows ---------------------------------------------------------------


def all_stopped_request_finished(tx, ev) -> bool:  # planted: D frees without P's verdict
    return tx.request_finished


def test_a_consumer_freeing_on_its_request_alone_is_caught_by_the_pair(tmp_path):
    bare = machine(without_invariants(tmp_path, "write_consumer"), all_stopped_request_finished)
    alone = check_machine(bare, SMALL)
    assert alone.ok, list(alone.findings)  # D has no writes of its own to watch
    pair = check_pair(
        "write", Bounds(layers=1, faults=0, tick_s="off"), machines={"write_consumer": bare}
    )
    finding = pair.findings["freed_under_operation"]
    assert "D: free_blocks while a write into its blocks" in finding.message


def test_final_states_that_are_not_absorbing_are_caught():
    """The validator refuses such a spec; the checker, handed it anyway, shows why."""

    def count_notify_failure(tx, ev, out) -> None:  # planted: changes a final record
        tx.notify_failures += 1

    text = spec_path("read_producer").read_text()
    row = "  - {event: notify_failed, source: leased, internal: true, actions: [count_notify_failure]}"
    assert row in text
    spec = parse_spec(
        text.replace(row, row.replace("source: leased", "source: [leased, released]"))
    )
    bindings = load_bindings(spec).replaced(count_notify_failure)
    result = check_machine(Machine(spec, bindings, resolve_config(spec, None)), SMALL)
    assert (
        "notify_failed was applied in final state 'released'"
        in result.findings["final_absorbing"].message
    )


@pytest.mark.parametrize(
    "name", ["write_producer", "write_consumer", "read_producer", "read_consumer"]
)
def test_the_shipped_specs_have_none_of_these_bugs(name):
    result = check_machine(machine(name), SMALL)
    assert result.ok, {rule: f.message for rule, f in result.findings.items()}
