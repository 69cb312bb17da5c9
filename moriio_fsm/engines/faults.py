"""Fault injection for the project's own engines (loopback, same host): failures, stalls, holds, latency, dead
sessions and peers.

Rules: every method is thread-safe and predicates run outside every lock; the engine
asks only ``decide`` and ``session_fault`` and carries out the answer itself; a session is
known here only by what ``FaultableSession`` declares.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .status import StatusCode

__all__ = [
    "FaultVerdict",
    "FaultableSession",
    "HeldTransfers",
    "InjectedFailure",
    "LoopbackFaults",
    "PostedTransfer",
]


class FaultableSession(Protocol):
    """What the fault rules need of a session: whom it reaches, and a word when it is killed."""

    remote_engine_key: str

    def note_killed(self) -> None:
        """Called by ``kill_session``: copies of this session in progress stop where they can."""


@dataclass(frozen=True, slots=True)
class PostedTransfer:
    """What fault predicates see about one posted batch."""

    sequence: int  # 1-based count of batches posted on this engine
    op: str  # "write" or "read"
    transfer_uid: int
    remote_engine_key: str
    count: int  # ranges in the batch
    total_bytes: int


@dataclass(frozen=True, slots=True)
class InjectedFailure:
    """The error a failed transfer ends with; it moves no bytes."""

    code: int
    message: str


class HeldTransfers:
    """Transfers that ``hold_nth`` / ``hold_when`` keep IN_PROGRESS until ``release``.

    A held transfer has been posted and does nothing else: it moves no bytes and
    its status stays IN_PROGRESS, for as long as the test needs, without any
    timing. ``release`` lets every held transfer complete as it would have
    (checks, copy, injected failure) and stops holding later matches. Closing the
    engine fails held transfers with ERR_BAD_STATE, as it does queued ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = False
        self._resumes: list[Callable[[], None]] = []

    @property
    def held(self) -> int:
        """How many transfers are held right now."""
        with self._lock:
            return len(self._resumes)

    @property
    def released(self) -> bool:
        with self._lock:
            return self._released

    def release(self) -> int:
        """Let the held transfers complete; returns how many were held. Idempotent."""
        with self._lock:
            self._released = True
            resumes, self._resumes = self._resumes, []
        # Outside the lock: a resume goes back into the engine, which takes its own.
        for resume in resumes:
            resume()
        return len(resumes)

    def keep(self, resume: Callable[[], None]) -> bool:
        """The engine holds one transfer here: ``resume()`` is called once, at release.

        Returns False, keeping nothing, when already released: run the transfer now.
        """
        with self._lock:
            if self._released:
                return False
            self._resumes.append(resume)
            return True

    def __repr__(self) -> str:
        state = "released" if self.released else f"holding {self.held}"
        return f"<HeldTransfers {state}>"


@dataclass(frozen=True, slots=True)
class FaultVerdict:
    """What the faults decided for one posted batch; the engine carries it out.

    ``failure``: end with this error (after ``delay_s``); ``stall``: stay in
    progress until the engine closes; ``hold``: keep it there until released.
    """

    failure: InjectedFailure | None = None
    stall: bool = False
    hold: HeldTransfers | None = None
    delay_s: float = 0.0


NO_FAULT = FaultVerdict()


@dataclass(slots=True, eq=False)
class _Rule:
    matches: Callable[[PostedTransfer], bool]
    once: bool
    failure: InjectedFailure | None = None
    hold: HeldTransfers | None = None


class LoopbackFaults:
    """Faults to inject into one engine's transfers; every method is thread-safe.

    Failure rules are checked in the order added; the first that matches decides
    the transfer's error (a failed transfer moves no bytes; a dropped one moves none
    either, yet reports success). A stalled transfer
    stays IN_PROGRESS until the engine closes; a held one until its
    ``HeldTransfers`` is released. Predicates run on the posting thread outside
    every lock, so they may call back into the engine and into this object; an
    exception they raise propagates out of the ``batch_*`` call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: list[_Rule] = []
        self._stalls: list[_Rule] = []
        self._holds: list[_Rule] = []
        self._latency_s = 0.0
        self._jitter_s = 0.0
        self._random = random.Random(0)
        # Weak, so a killed session leaves no trace once collected and a later
        # session that happens to reuse its address is not taken for dead.
        self._dead_sessions: weakref.WeakSet[FaultableSession] = weakref.WeakSet()
        self._dead_peers: set[str] = set()

    def fail_nth(self, n: int, code: int = StatusCode.ERR_RDMA_OP, message: str = "") -> None:
        """Fail the ``n``-th batch posted on this engine (1-based)."""
        n = _positive("n", n)
        self._add_failure(
            lambda posted: posted.sequence == n,
            code,
            message or f"injected RDMA failure of transfer #{n}",
            once=True,
        )

    def fail_when(
        self,
        predicate: Callable[[PostedTransfer], bool],
        code: int = StatusCode.ERR_RDMA_OP,
        message: str = "",
    ) -> None:
        """Fail every posted batch for which ``predicate`` returns True."""
        self._add_failure(
            _callable(predicate), code, message or "injected RDMA failure", once=False
        )

    def drop_nth(self, n: int) -> None:
        """Report the ``n``-th batch a success without moving a byte (a lying engine).

        For negative controls: a transfer that "succeeds" but delivers nothing must
        show up downstream (wrong tokens), or the checks downstream prove nothing.
        """
        n = _positive("n", n)
        self._add(
            self._failures,
            _Rule(
                lambda posted: posted.sequence == n,
                once=True,
                failure=InjectedFailure(StatusCode.SUCCESS, f"transfer #{n} dropped"),
            ),
        )

    def drop_when(self, predicate: Callable[[PostedTransfer], bool]) -> None:
        """Report every batch ``predicate`` matches a success without moving a byte."""
        self._add(
            self._failures,
            _Rule(
                _callable(predicate),
                once=False,
                failure=InjectedFailure(StatusCode.SUCCESS, "transfer dropped"),
            ),
        )

    def stall_nth(self, n: int) -> None:
        """Leave the ``n``-th posted batch in progress forever (until close)."""
        n = _positive("n", n)
        self._add(self._stalls, _Rule(lambda posted: posted.sequence == n, once=True))

    def stall_when(self, predicate: Callable[[PostedTransfer], bool]) -> None:
        self._add(self._stalls, _Rule(_callable(predicate), once=False))

    def hold_nth(self, n: int) -> HeldTransfers:
        """Hold the ``n``-th batch posted on this engine (1-based) IN_PROGRESS until released."""
        n = _positive("n", n)
        return self._add_hold(lambda posted: posted.sequence == n, once=True)

    def hold_when(self, predicate: Callable[[PostedTransfer], bool]) -> HeldTransfers:
        """Hold every posted batch for which ``predicate`` returns True, until released."""
        return self._add_hold(_callable(predicate), once=False)

    def set_latency(self, latency_s: float, jitter_s: float = 0.0, seed: int | None = 0) -> None:
        """Delay each completion by ``latency_s`` plus uniform [0, ``jitter_s``) seconds."""
        if latency_s < 0 or jitter_s < 0:
            raise ValueError(
                f"latency_s and jitter_s must be >= 0 seconds, got {latency_s} and {jitter_s}"
            )
        with self._lock:
            self._latency_s = float(latency_s)
            self._jitter_s = float(jitter_s)
            self._random = random.Random(seed)

    def kill_session(self, session: FaultableSession) -> None:
        """Break one session: its queued and future transfers fail with ERR_RDMA_OP, and a
        copy in progress for it stops at the next piece where the engine can stop one."""
        with self._lock:
            self._dead_sessions.add(session)
        session.note_killed()

    def kill_peer(self, engine_key: str) -> None:
        """Make a remote engine unreachable: every session to it fails with ERR_RDMA_OP."""
        with self._lock:
            self._dead_peers.add(engine_key)

    def clear(self) -> None:
        """Remove every rule, latency and killed session or peer.

        Transfers already held stay held until their ``HeldTransfers`` is released.
        """
        with self._lock:
            self._failures.clear()
            self._stalls.clear()
            self._holds.clear()
            self._latency_s = self._jitter_s = 0.0
            self._dead_sessions.clear()
            self._dead_peers.clear()

    # -- what the engine asks ----------------------------------------------------
    def decide(self, posted: PostedTransfer) -> FaultVerdict:
        """The faults for one batch just posted; one-shot rules it matches are used up."""
        failure_rule = self._first_match(self._failures, posted)
        stall = failure_rule is None and self._first_match(self._stalls, posted) is not None
        hold = None
        if not stall:
            held_by = self._first_match(self._holds, posted)
            hold = held_by.hold if held_by is not None else None
        with self._lock:
            delay = self._latency_s
            if self._jitter_s:
                delay += self._random.uniform(0.0, self._jitter_s)
        failure = failure_rule.failure if failure_rule is not None else None
        if failure is None and not stall and hold is None and not delay:
            return NO_FAULT  # the common case builds nothing
        return FaultVerdict(failure, stall, hold, delay)

    def session_fault(self, session: FaultableSession) -> str | None:
        """Why ``session``'s transfers must fail (it or its peer was killed), or None."""
        with self._lock:
            if session in self._dead_sessions:
                return "session was killed"
            if session.remote_engine_key in self._dead_peers:
                return f"peer engine {session.remote_engine_key!r} is unreachable"
        return None

    # -- rules -------------------------------------------------------------------
    def _add_failure(self, matches, code: int, message: str, once: bool) -> None:
        code = int(code)
        if code <= 10:
            raise ValueError(f"an injected failure needs an error code above 10, got {code}")
        self._add(self._failures, _Rule(matches, once, failure=InjectedFailure(code, message)))

    def _add_hold(self, matches, once: bool) -> HeldTransfers:
        hold = HeldTransfers()
        self._add(self._holds, _Rule(matches, once, hold=hold))
        return hold

    def _add(self, rules: list[_Rule], rule: _Rule) -> None:
        with self._lock:
            rules.append(rule)

    def _first_match(self, rules: list[_Rule], posted: PostedTransfer) -> _Rule | None:
        """The first rule matching ``posted``; a one-shot rule is used up by it.

        Predicates are called outside the lock, on a snapshot of the rules.
        """
        if not rules:
            return None
        with self._lock:
            candidates = list(rules)
        for rule in candidates:
            if rule.hold is not None and rule.hold.released:
                with self._lock:
                    if rule in rules:
                        rules.remove(rule)
                continue
            if not rule.matches(posted):
                continue
            if rule.once:
                with self._lock:
                    if rule not in rules:
                        continue  # another thread's post used it up meanwhile
                    rules.remove(rule)
            return rule
        return None


def _callable(predicate: Any) -> Callable[[PostedTransfer], bool]:
    if not callable(predicate):
        raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
    return predicate


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (1-based), got {value!r}")
    return value
