"""The effect rules: what the effects one transfer emits must obey, whatever its spec says.

Rules: the observer watches the events a transfer is handed and the effects its steps
emit, never its context, so a spec whose own invariants are wrong is still caught. Each
rule applies to a spec that declares the emits it is about (the kinds below are the
shipped specs' names for them). What it remembers is a small tuple, part of every
explored state, because the rules are about history (once, after, never while):

- blocks leave (are handed back, or quarantined) at most once, and exactly once by the
  end when the transfer ever held them (posted an operation on them, asked vLLM to hold
  them, or gave them to the peer); never while an operation of this side on them may be
  in flight (the block ledger's rules, ``moriio_fsm.ledger``, seen from one side: its
  ``freed_under_operation`` is ``no_handback_in_flight`` here, as only this side's
  operations are seen);
- write_done is sent at most once, and only after every write sealed (the layers
  scheduled before the first seal that had any) completed, none having failed;
- a transfer that ends without success (in a final state that is not an anomaly)
  has told the peer (write_failed, release); it never tells the peer that its writes or
  reads stopped while one of them may be in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ledger
from ..lang.model import Spec
from ..ledger import HANDBACKS, QUARANTINE

POSTS = frozenset({"post_write", "post_read"})
TEARDOWNS = frozenset({"abandon_writes", "abandon_reads"})
HOLDS = frozenset({"hold_blocks", "hold_for_reads"})
HANDOVERS = frozenset({"send_remote_blocks"})
FAILURE_NEWS = frozenset({"send_write_failed", "send_release"})
SUCCESSES = frozenset({"send_write_done", "report_received"})
#: Messages that tell the peer this side's operations are over (write_failed only when
#: it says writes_stopped).
STOP_NEWS = frozenset({"send_write_done", "send_write_failed", "send_release"})

COMPLETIONS = frozenset({"layer_write_completed", "layer_read_completed"})
FAILURES = frozenset({"layer_write_failed", "layer_read_failed", "post_failed"})
CONFIRMATIONS = frozenset({"writes_abandoned", "reads_abandoned"})
HOLD_FAILURES = frozenset({"hold_failed"})

# Why a transfer holds blocks (bits of `custody`).
_OPS, _HOLD, _HANDED_OVER = 1, 2, 4

# Slots of the observer's tuple.
(
    LEAVES,
    QUARANTINED,
    CUSTODY,
    IN_FLIGHT,
    TEARDOWN,
    SCHEDULED,
    SEALED,
    COMPLETED,
    OP_FAILED,
    WRITE_DONE,
    TOLD_FAILURE,
    SUCCEEDED,
) = range(12)

INITIAL = (0, False, 0, 0, 0, 0, -1, 0, False, 0, False, False)


@dataclass(frozen=True)
class Breach:
    """One broken effect rule: its name and what happened."""

    rule: str
    message: str


class Observer:
    """The effect rules for one spec. ``after`` folds one step into the remembered tuple;
    ``at_end`` judges a transfer that reached a final state."""

    def __init__(self, spec: Spec, layers: int):
        emits = set(spec.emits)
        self.spec = spec
        self._layers = layers
        self._watch_write_done = "send_write_done" in emits
        self._tells_failure = bool(FAILURE_NEWS & emits)
        self._anomaly = frozenset(spec.anomaly_states)
        self._final = frozenset(spec.final_states)
        watched_events = COMPLETIONS | FAILURES | CONFIRMATIONS | HOLD_FAILURES
        if self._watch_write_done:
            watched_events |= {"layer_scheduled", "layers_scheduled", "seal"}
        self._events = frozenset(watched_events) & set(spec.events)

    def after(self, memory: tuple, ev, effects, state: str) -> tuple[tuple, list[Breach]]:
        """The memory after event ``ev`` led to ``effects`` (in order) and ``state``."""
        if ev.kind not in self._events and not effects and state not in self._final:
            return memory, []
        m = list(memory)
        breaches: list[Breach] = []
        self._see_event(m, ev)
        for effect in effects:
            self._see_effect(m, effect, breaches, ev.kind)
        if state in self._final:
            breaches.extend(self.at_end(m, state))
        return tuple(m), breaches

    # -- events ----------------------------------------------------------------------

    def _see_event(self, m: list, ev) -> None:
        kind = ev.kind
        if kind not in self._events:
            return
        layer = getattr(ev, "layer", None)
        bit = 1 << layer if isinstance(layer, int) and 0 <= layer < self._layers else 0
        if kind in COMPLETIONS or kind in FAILURES:
            if m[IN_FLIGHT] & bit:
                m[IN_FLIGHT] &= ~bit
                m[TEARDOWN] &= ~bit
                if kind in COMPLETIONS:
                    m[COMPLETED] |= bit
                else:
                    m[OP_FAILED] = True
        elif kind in CONFIRMATIONS:
            m[IN_FLIGHT] &= ~m[TEARDOWN]
            m[TEARDOWN] = 0
        elif kind in HOLD_FAILURES:
            m[CUSTODY] &= ~_HOLD
        elif kind == "layer_scheduled":
            if m[SEALED] < 0:
                m[SCHEDULED] |= bit
        elif kind == "layers_scheduled":
            layers = ev.layers
            if m[SEALED] < 0 and isinstance(layers, int) and layers > 0:
                m[SCHEDULED] |= layers & ((1 << self._layers) - 1)
        elif kind == "seal":
            if m[SEALED] < 0 and m[SCHEDULED]:
                m[SEALED] = m[SCHEDULED]

    # -- effects ---------------------------------------------------------------------

    def _see_effect(self, m: list, effect, breaches: list[Breach], cause: str) -> None:
        kind = effect.kind
        if kind in POSTS:
            layer = effect.layer
            if 0 <= layer < self._layers:
                m[IN_FLIGHT] |= 1 << layer
            m[CUSTODY] |= _OPS
        elif kind in TEARDOWNS:
            for layer in effect.layers:
                if 0 <= layer < self._layers:
                    m[TEARDOWN] |= 1 << layer
        elif kind in HOLDS:
            m[CUSTODY] |= _HOLD
        elif kind in HANDOVERS:
            m[CUSTODY] |= _HANDED_OVER
        elif kind == QUARANTINE:
            _see_violation(breaches, ledger.quarantine(_where(m))[1])
            m[LEAVES] = min(m[LEAVES] + 1, 2)
            m[QUARANTINED] = True
        elif kind in HANDBACKS and not ledger.frees_nothing(_where(m), kind):
            touching = f"layer(s) {_layers(m[IN_FLIGHT])}" if m[IN_FLIGHT] else ""
            _see_violation(breaches, ledger.hand_back(_where(m), kind, touching)[1])
            m[LEAVES] = min(m[LEAVES] + 1, 2)
        if kind in SUCCESSES:
            m[SUCCEEDED] = True
        if kind in FAILURE_NEWS:
            m[TOLD_FAILURE] = True
        if kind in STOP_NEWS and m[IN_FLIGHT] and getattr(effect, "writes_stopped", True):
            breaches.append(
                Breach(
                    "peer_told_only_when_quiet",
                    f"{kind} told the peer this side stopped while layer(s) "
                    f"{_layers(m[IN_FLIGHT])} may still be in flight",
                )
            )
        if kind == "send_write_done":
            # Said again only when D's release asks (D may have lost the first).
            if m[WRITE_DONE] and cause != "release":
                breaches.append(Breach("write_done_once", "send_write_done a second time, unasked"))
            m[WRITE_DONE] = min(m[WRITE_DONE] + 1, 2)
            sealed = m[SEALED]
            if sealed <= 0:
                breaches.append(
                    Breach(
                        "write_done_after_sealed_writes",
                        "send_write_done before any layer was sealed",
                    )
                )
            elif sealed & ~m[COMPLETED] or m[OP_FAILED]:
                missing = sealed & ~m[COMPLETED]
                why = (
                    f"sealed layer(s) {_layers(missing)} not completed"
                    if missing
                    else "a write failed"
                )
                breaches.append(
                    Breach("write_done_after_sealed_writes", f"send_write_done while {why}")
                )

    # -- the end ---------------------------------------------------------------------

    def at_end(self, m, state: str) -> list[Breach]:
        breaches = []
        if m[CUSTODY] and not m[LEAVES]:
            breaches.append(Breach(*ledger.never_left(state)))
        if (
            self._tells_failure
            and state not in self._anomaly
            and not m[SUCCEEDED]
            and not m[TOLD_FAILURE]
        ):
            breaches.append(
                Breach(
                    "failure_tells_peer",
                    f"ended in {state!r} without success and without telling the peer",
                )
            )
        return breaches


def _where(m) -> int:
    """Where the blocks are, in the ledger's terms."""
    if m[QUARANTINED]:
        return ledger.QUARANTINED
    return ledger.GONE if m[LEAVES] else ledger.HELD


def _see_violation(breaches: list[Breach], violation: ledger.Violation | None) -> None:
    if violation is None:
        return
    rule = violation.rule
    if rule == ledger.FREED_UNDER_OPERATION:
        rule = "no_handback_in_flight"  # this side's operations only
    breaches.append(Breach(rule, violation.message))


def _layers(bitmap: int) -> str:
    return ", ".join(str(i) for i in range(bitmap.bit_length()) if bitmap >> i & 1)
