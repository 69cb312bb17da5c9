"""A producer and a consumer machine together, over a channel that may lose, duplicate
and reorder messages, with an engine that may fail, stall or never confirm a teardown.

Rules: one P rank and one D rank of one mode (``write``: write_producer with
write_consumer; ``read``: read_producer with read_consumer), each running its real steps
(``stepper.py``). Effects are carried out here, the way the driver carries them out (in
the order emitted, a raising handler turning into the emit's ``on_failure`` event for the
same transfer), so that every outcome of every handler can be explored: a message goes
into the channel, an operation goes in flight on the engine, blocks go back or into
quarantine. The world's moves: the hosts' local events, timers, time passing, delivering
any message (or a copy of it, keeping it), making one late, the engine completing or
failing an operation or confirming a teardown, and in READ mode the handshake's answer
and the proxy starting D once P held its blocks. A message arrives at the instant it was
sent, in any order with everything else that happens then, or is lost when time moves
on; a late one arrives at any later time, or never. Faults (a duplicated or late message,
a failed operation, handshake or handler) count against ``Bounds.faults``; losing a
message is free, and an operation that stalls simply never completes.

What each effect does to blocks, operations and the channel, and the block ledger's rules
it is checked against, are ``pair_effects.py``. And both sides end: from every reachable
state, timers, time and the hosts alone bring both to a final state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ..ledger import GONE, HELD
from ..machines import build_machine
from ..runtime.declared import make_event
from ..runtime.errors import InvariantViolation, TransitionError
from ..runtime.events import Event
from ..runtime.timers import TimerPlan
from .alphabet import Alphabet
from .bounds import Bounds, CheckUsageError
from .explore import Move
from .joint import LATE, NOT_STARTABLE, STARTABLE, STARTED, Joint, show_message
from .observer import Breach
from .pair_effects import PairEffects
from .single import Dispatch, TimePasses, breach_of, next_instant
from .stepper import TRANSFER_ID, Stepper, _thaw

#: The machines of each mode, producer first.
MODES = {
    "write": ("write_producer", "write_consumer"),
    "read": ("read_producer", "read_consumer"),
}

#: Timeouts for pair runs. WRITE keeps the shipped defaults (their common step, 10 s, is
#: small next to a transfer's life). READ scales them down keeping their order (the read
#: budget plus margin under the lease, the teardown under the margin): the shipped ones
#: share a step of 1 s over a life of minutes, which would multiply the states by
#: hundreds without adding any order of events.
PAIR_CONFIGS: dict[str, dict[str, dict[str, float]]] = {
    # D's release repeats on the other timers' 10 s grid, twice: each repeat is a release
    # and an answer in flight, and a 2 s repeat would make "auto" time step by 2 s.
    "write": {
        "write_producer": {},
        "write_consumer": {"release_repeat_s": 20.0, "max_release_repeats": 2},
    },
    "read": {
        "read_producer": {"lease_s": 6.0, "max_hold_s": 24.0},
        "read_consumer": {
            "setup_timeout_s": 4.0,
            "read_timeout_s": 2.0,
            "renew_interval_s": 1.0,
            "lease_margin_s": 2.0,
            "abandon_timeout_s": 1.0,
        },
    },
}

_ERROR = "injected"


class WorldNote(NamedTuple):
    """A counterexample's step that is the world's doing, not a machine's."""

    text: str


@dataclass
class _Branch:
    joint: Joint | None  # None once a step broke a rule: the branch ends there
    cost: int
    labels: list
    breaches: list
    pending: tuple  # events still to dispatch to the side being settled


class PairModel:
    """The world of one P and one D rank of ``mode`` (``Model`` for ``explore.search``)."""

    def __init__(
        self,
        mode: str,
        bounds: Bounds,
        *,
        configs: dict | None = None,
        specs: dict[str, str] | None = None,
        machines: dict | None = None,
    ):
        if mode not in MODES:
            raise CheckUsageError(
                f"unknown pair mode {mode!r}; expected one of {', '.join(sorted(MODES))}"
            )
        self.mode = mode
        self.name = f"{mode} pair ({' x '.join(MODES[mode])})"
        self.bounds = bounds
        configs = {
            name: {**PAIR_CONFIGS[mode].get(name, {}), **(configs or {}).get(name, {})}
            for name in MODES[mode]
        }
        specs, machines = specs or {}, machines or {}
        unknown = sorted((set(specs) | set(machines) | set(configs)) - set(MODES[mode]))
        if unknown:
            raise CheckUsageError(
                f"the {mode} pair runs {' and '.join(MODES[mode])}, not {', '.join(unknown)}"
            )
        self.machines = [
            machines.get(name) or build_machine(specs.get(name, name), config=configs.get(name))
            for name in MODES[mode]
        ]
        self.steppers = [Stepper(machine) for machine in self.machines]
        self.side_names = ("P", "D")
        self._final = [machine.final for machine in self.machines]
        self._finals = tuple(self._final)
        self._local = [
            [
                c
                for c in Alphabet(machine.spec, bounds).events
                if c.origin == "local" and not machine.spec.events[c.kind].creates
            ]
            for machine in self.machines
        ]
        durations = [
            d
            for machine in self.machines
            for d in TimerPlan(machine.spec, machine.config).durations
        ]
        self.tick = bounds.tick_for(durations, "auto")
        self._failure_of = [
            {
                name: (emit.on_failure, tuple(machine.spec.events[emit.on_failure].payload))
                for name, emit in machine.spec.emits.items()
                if emit.on_failure
            }
            for machine in self.machines
        ]
        self._effects = PairEffects(mode, bounds.layers, self.side_names)

    # -- Model -------------------------------------------------------------------------

    def initial(self):
        empty = Joint(self._finals, (0.0, None, None, (), 0, 0, HELD, HELD, 0, NOT_STARTABLE))
        if self.mode == "write":
            creations = [
                (0, make_event("prefill_started", TRANSFER_ID, 0.0, {"num_writers": 1})),
                (1, make_event("receive_started", TRANSFER_ID, 0.0, {"num_writers": 1})),
            ]
        else:
            creations = [
                (0, make_event("serve_started", TRANSFER_ID, 0.0, {"consumer_tp_size": 1}))
            ]
        branches = [_Branch(empty, 0, [], [], ())]
        for side, ev in creations:
            branches = [
                done
                for branch in branches
                for done in self._create(branch, side, ev, self.bounds.faults)
            ]
        for branch in branches:
            yield self._move(branch, peer_free=True)

    def successors(self, state, allowance: int):
        joint = Joint(self._finals, state)
        moves: list[Move] = []
        now = joint.now
        due = False
        for side in (0, 1):
            key = joint.key(side)
            if key is None or key[0] in self._final[side]:
                continue
            for index, deadline in enumerate(key[1]):
                if deadline is not None and deadline <= now:
                    due = True
                    ev = self.steppers[side].timer_event(index, deadline)
                    moves += self._react(joint, side, ev, 0, allowance, peer_free=True)
        if not due:
            deadlines = [d for side in (0, 1) for d in self._live_deadlines(joint, side)]
            later = next_instant(now, deadlines, self.tick)
            if later is not None:
                moved = joint.copy()
                moved.now = later
                # A message not delivered by the time it was due is lost.
                moved.channel = [m for m in moved.channel if m[0] >= later]
                moves.append(Move(TimePasses(later), moved.freeze(), 0, True, []))
        for side in (0, 1):
            key = joint.key(side)
            if key is None or key[0] in self._final[side]:
                continue
            for concrete in self._local[side]:
                moves += self._react(
                    joint, side, concrete.build(TRANSFER_ID, now), 0, allowance, peer_free=True
                )
        if self.mode == "read" and joint.d_start == STARTABLE:
            moves += self._start_reader(joint, allowance)
        moves += self._channel_moves(joint, allowance)
        moves += self._engine_moves(joint, allowance)
        return moves

    def ended(self, state) -> bool:
        joint = Joint(self._finals, state)
        p_done = joint.p is not None and joint.p[0] in self._final[0]
        if joint.d is None:
            return p_done and joint.d_start == NOT_STARTABLE
        return p_done and joint.d[0] in self._final[1]

    def end_breaches(self, state) -> list[Breach]:
        return []

    def describe_stuck(self, state) -> str:
        joint = Joint(self._finals, state)
        sides = [
            f"{name} {'not started' if key is None else repr(key[0])}"
            for name, key in zip(self.side_names, (joint.p, joint.d))
        ]
        return f"for example with {' and '.join(sides)} at t={joint.now:g}"

    # -- moves of the world ------------------------------------------------------------

    def _channel_moves(self, joint: Joint, allowance: int) -> list[Move]:
        moves: list[Move] = []
        for message in sorted(set(joint.channel)):
            due, to, kind, data = message
            side = 0 if to == "P" else 1
            for keep, cost, what in ((False, 0, "delivered"), (True, 1, "duplicated")):
                if cost > allowance:
                    continue
                world = joint.copy()
                if not keep:
                    world.channel.remove(message)
                note = WorldNote(f"{show_message(message)} {what}")
                ev = make_event(
                    kind, TRANSFER_ID, joint.now, {n: _thaw(v) for n, v in data}, source="peer"
                )
                moves += self._react(world, side, ev, cost, allowance, peer_free=False, note=note)
            if due != LATE and allowance >= 1:
                world = joint.copy()
                world.channel.remove(message)
                world.channel.append((LATE, to, kind, data))
                moves.append(
                    Move(
                        (WorldNote(f"{show_message(message)} is late"),),
                        world.freeze(),
                        1,
                        False,
                        [],
                    )
                )
        return moves

    def _engine_moves(self, joint: Joint, allowance: int) -> list[Move]:
        moves: list[Move] = []
        owner = 0 if self.mode == "write" else 1
        op = "write" if self.mode == "write" else "read"
        for layer in range(self.bounds.layers):
            bit = 1 << layer
            if not joint.in_flight & bit:
                continue
            for ok, cost in ((True, 0), (False, 1)):
                if cost > allowance:
                    continue
                world = joint.copy()
                world.in_flight &= ~bit
                world.teardown &= ~bit
                kind = f"layer_{op}_completed" if ok else f"layer_{op}_failed"
                data = {"layer": layer} if ok else {"layer": layer, "code": 13}
                note = WorldNote(
                    f"the engine {'completed' if ok else 'failed'} the {op} of layer {layer}"
                )
                moves += self._react(
                    world,
                    owner,
                    make_event(kind, TRANSFER_ID, joint.now, data),
                    cost,
                    allowance,
                    peer_free=False,
                    note=note,
                )
        if joint.teardown:
            world = joint.copy()
            world.in_flight &= ~world.teardown
            world.teardown = 0
            kind = "writes_abandoned" if self.mode == "write" else "reads_abandoned"
            moves += self._react(
                world,
                owner,
                make_event(kind, TRANSFER_ID, joint.now),
                0,
                allowance,
                peer_free=False,
                note=WorldNote(f"the engine confirmed the teardown ({kind})"),
            )
        if self.mode == "read" and joint.handshake:
            for ok, cost in ((True, 0), (False, 1)):
                if cost > allowance:
                    continue
                world = joint.copy()
                world.handshake = 0
                ev = (
                    make_event("handshake_done", TRANSFER_ID, joint.now)
                    if ok
                    else make_event("handshake_failed", TRANSFER_ID, joint.now, {"error": _ERROR})
                )
                moves += self._react(
                    world,
                    1,
                    ev,
                    cost,
                    allowance,
                    peer_free=False,
                    note=WorldNote(f"the handshake {'answered' if ok else 'failed'}"),
                )
        return moves

    def _start_reader(self, joint: Joint, allowance: int) -> list[Move]:
        world = joint.copy()
        world.d_start = STARTED
        ev = make_event(
            "read_started",
            TRANSFER_ID,
            joint.now,
            {"num_layers": self.bounds.layers, "remote_block_ids": [7]},
        )
        note = WorldNote("the proxy passed P's read parameters to D")
        branches = self._create(_Branch(world, 0, [note], [], ()), 1, ev, allowance)
        return [self._move(branch, peer_free=True) for branch in branches]

    # -- dispatching and carrying out --------------------------------------------------

    def _react(
        self,
        joint: Joint,
        side: int,
        ev: Event,
        cost: int,
        allowance: int,
        *,
        peer_free: bool,
        note: WorldNote | None = None,
    ) -> list[Move]:
        """Hand ``ev`` to ``side`` (copying ``joint`` first) and settle what follows."""
        labels = [note] if note is not None else []
        key = joint.key(side)
        if key is None or key[0] in self._final[side]:
            # Nothing there to take it (ended: the table answers LATE, changing nothing).
            if note is None:
                return []
            return [Move(tuple(labels), joint.freeze(), cost, peer_free, [])]
        branch = _Branch(joint.copy() if note is None else joint, cost, labels, [], (ev,))
        return [self._move(done, peer_free) for done in self._settle(branch, side, allowance)]

    def _create(self, branch: _Branch, side: int, ev: Event, allowance: int) -> list[_Branch]:
        if branch.joint is None:
            return [branch]  # the other side's creation broke a rule: it ends there
        stepper = self.steppers[side]
        try:
            result, key = stepper.create(ev)
        except (InvariantViolation, TransitionError) as exc:
            return [
                _Branch(
                    None,
                    branch.cost,
                    branch.labels + [Dispatch(self._who(side), ev, None)],
                    branch.breaches + [breach_of(exc)],
                    (),
                )
            ]
        if key is None:
            raise CheckUsageError(
                f"{self.machines[side].spec.name} refused its creating event "
                f"{ev!r} in the {self.mode} pair"
            )
        branch.joint.set_key(side, key)
        branch.labels = branch.labels + [Dispatch(self._who(side), ev, result)]
        return self._carry_out_all(branch, side, result.effects, allowance)

    def _settle(self, branch: _Branch, side: int, allowance: int) -> list[_Branch]:
        """Dispatch the branch's pending events to ``side`` in order, carrying out each
        step's effects (which may add failure events); every way it can go."""
        done: list[_Branch] = []
        work = [branch]
        stepper = self.steppers[side]
        while work:
            branch = work.pop()
            if branch.joint is None or not branch.pending:
                done.append(branch)
                continue
            ev, rest = branch.pending[0], branch.pending[1:]
            key = branch.joint.key(side)
            if key[0] in self._final[side]:
                branch.pending = rest  # LATE: the ended transfer takes nothing
                work.append(branch)
                continue
            try:
                result, key = stepper.run(stepper.load(key), ev)
            except (InvariantViolation, TransitionError) as exc:
                done.append(
                    _Branch(
                        None,
                        branch.cost,
                        branch.labels + [Dispatch(self._who(side), ev, None)],
                        branch.breaches + [breach_of(exc)],
                        (),
                    )
                )
                continue
            branch.joint.set_key(side, key)
            branch.labels = branch.labels + [Dispatch(self._who(side), ev, result)]
            branch.pending = rest
            work.extend(self._carry_out_all(branch, side, result.effects, allowance))
        return done

    def _carry_out_all(self, branch: _Branch, side: int, effects, allowance: int) -> list[_Branch]:
        branches = [branch]
        for effect in effects:
            next_branches = []
            for b in branches:
                if b.joint is None:
                    next_branches.append(b)
                    continue
                failure = self._failure_of[side].get(effect.kind)
                if failure is not None and b.cost < allowance:
                    # The handler raised: the driver hands the transfer the emit's failure event.
                    kind, fields = failure
                    data = {f: getattr(effect, f) for f in fields if f in effect.__struct_fields__}
                    if "error" in fields:
                        data["error"] = _ERROR
                    ev = make_event(kind, TRANSFER_ID, b.joint.now, data)
                    failed = b.joint.copy()
                    if self.mode == "read" and effect.kind == "hold_for_reads":
                        failed.p_blocks = GONE  # vLLM frees what the connector could not hold
                    next_branches.append(
                        _Branch(
                            failed,
                            b.cost + 1,
                            b.labels + [WorldNote(f"the handler of {effect.kind} raised")],
                            list(b.breaches),
                            b.pending + (ev,),
                        )
                    )
                breaches: list[Breach] = []
                self._effects.carry_out(b.joint, side, effect, breaches)
                if breaches:
                    b.breaches = b.breaches + breaches
                next_branches.append(b)
            branches = next_branches
        return branches

    def _move(self, branch: _Branch, peer_free: bool) -> Move:
        state = None if branch.joint is None else branch.joint.freeze()
        return Move(tuple(branch.labels), state, branch.cost, peer_free, branch.breaches)

    # -- helpers -------------------------------------------------------------------------

    def _live_deadlines(self, joint: Joint, side: int):
        key = joint.key(side)
        if key is None or key[0] in self._final[side]:
            return ()
        return key[1]

    def trace_sides(self) -> dict[str, tuple[str, Any]]:
        """Trace side and machine of each machine label in this model's counterexamples."""
        return {self._who(side): (self.side_names[side], self.machines[side]) for side in (0, 1)}

    def _who(self, side: int) -> str:
        return f"{self.side_names[side]} {self.machines[side].spec.name}"
