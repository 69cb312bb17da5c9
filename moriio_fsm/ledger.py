"""The block ledger: every rule about a transfer's KV blocks, each defined once, and the
ledger a simulated world keeps of whose blocks each operation uses.

Rules: blocks leave (go back to vLLM through ``free_blocks``, ``report_received`` or
``report_load_failure``, or are quarantined) at most once, except that a failed-load
report of quarantined blocks frees nothing; they never go back while an operation that
may still write into them is in flight, nor while one reading from them is, unless the
blocks that read lands in are quarantined; no operation is posted on blocks that went
back, nor moves their bytes. A breach is a ``Violation`` (its rule and what happened),
never an exception. ``hand_back``, ``quarantine``, ``posted`` and ``moved`` judge one
step from the blocks' custody; ``Ledger`` keeps custody and operations for the joint
simulation (``sim``) and the chaos run (``chaos``); the model checker (``check``) keeps
them in its states and calls the same judges.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

#: Where one side's blocks of one transfer are.
HELD, GONE, QUARANTINED = 0, 1, 2

#: The effects that give blocks back to vLLM, and the one that keeps them out for good.
HANDBACKS = frozenset({"free_blocks", "report_received", "report_load_failure"})
FAILED_LOAD = "report_load_failure"
QUARANTINE = "quarantine_blocks"
#: Every effect that moves blocks (a consumer may emit each of them).
BLOCK_EFFECTS = HANDBACKS | {QUARANTINE}

#: The rules.
LEAVE_ONCE = "blocks_leave_once"
FREED_UNDER_OPERATION = "freed_under_operation"
OPERATION_ON_FREED = "operation_on_freed_blocks"


class Violation(NamedTuple):
    """One broken block rule: its name and what happened."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


def frees_nothing(custody: int, why: str) -> bool:
    """Whether handing back through ``why`` leaves the blocks where they are: vLLM frees
    nothing on a failed load of blocks the connector quarantined."""
    return custody == QUARANTINED and why == FAILED_LOAD


def hand_back(
    custody: int, why: str, touching: str = "", *, owner: str = "", left: str = ""
) -> tuple[int, Violation | None]:
    """Blocks in ``custody`` go back through ``why`` while ``touching`` (what may still
    be in flight on them, "" for nothing) is: their custody after it and the rule it
    broke, if any. ``owner`` names the blocks, ``left`` how they left before (when known)."""
    if frees_nothing(custody, why):
        return custody, None
    if custody != HELD:
        return custody, _left_again(custody, why, owner, left)
    if touching:
        return GONE, Violation(
            FREED_UNDER_OPERATION, f"{_named(owner)}{why} while {touching} may still be in flight"
        )
    return GONE, None


def quarantine(custody: int, *, owner: str = "", left: str = "") -> tuple[int, Violation | None]:
    """Blocks in ``custody`` are quarantined: kept from vLLM for good."""
    return QUARANTINED, None if custody == HELD else _left_again(custody, QUARANTINE, owner, left)


def posted(custody: int, what: str, *, owner: str = "", left: str = "") -> Violation | None:
    """Operation ``what`` was posted on blocks in ``custody``."""
    if custody != GONE:
        return None
    return Violation(
        OPERATION_ON_FREED, f"{_named(owner)}{what} posted after the blocks went back{_how(left)}"
    )


def moved(custody: int, what: str, *, owner: str = "", left: str = "") -> Violation | None:
    """Operation ``what`` moved bytes from or into blocks in ``custody`` just now."""
    if custody != GONE:
        return None
    return Violation(
        OPERATION_ON_FREED,
        f"{_named(owner)}{what} moved bytes after the blocks went back{_how(left)}",
    )


def reaches(blocks_are_target: bool, target: int) -> bool:
    """Whether an operation in flight may still do harm through blocks it uses: it writes
    into them, or it reads from them into blocks that are not quarantined (what lands in
    quarantined blocks is never used)."""
    return blocks_are_target or target != QUARANTINED


def never_left(state: str) -> Violation:
    """A transfer ended in ``state`` still holding blocks."""
    return Violation(
        LEAVE_ONCE, f"ended in {state!r} holding blocks it never handed back nor quarantined"
    )


def _left_again(custody: int, why: str, owner: str, left: str) -> Violation:
    if custody == QUARANTINED:
        return Violation(LEAVE_ONCE, f"{_named(owner)}{why} after the blocks were quarantined")
    return Violation(
        LEAVE_ONCE, f"{_named(owner)}{why} after the blocks had already left{_how(left)}"
    )


def _named(owner: str) -> str:
    return f"{owner}: " if owner else ""


def _how(left: str) -> str:
    return f" ({left})" if left else ""


# -- the ledger of a simulated world ---------------------------------------------------------


@dataclass(eq=False)
class Blocks:
    """One rank's blocks of one transfer (a P rank's source, a D rank's target)."""

    owner: str  # "node/transfer", for messages
    custody: int = HELD
    left: str = ""  # how they first left; "" while held
    dead: bool = False  # their process died: no longer judged


@dataclass(eq=False)
class Operation:
    """One posted RDMA operation: it reads ``source`` and writes ``target``."""

    what: str
    source: Blocks
    target: Blocks
    in_flight: bool = True


class Ledger:
    """Custody of every rank's blocks and the operations on them; breaches are counted
    per rule and the first ``keep`` of them kept (all when ``keep`` is None)."""

    def __init__(self, keep: int | None = None):
        self.keep = keep
        self.counts: Counter[str] = Counter()
        self.violations: list[Violation] = []
        self._blocks: dict[tuple[str, str], Blocks] = {}
        self._ops: dict[int, list[Operation]] = {}  # id(Blocks) -> operations on them

    def blocks(self, node: str, transfer_id: str) -> Blocks:
        key = (node, transfer_id)
        found = self._blocks.get(key)
        if found is None:
            found = self._blocks[key] = Blocks(f"{node}/{transfer_id}")
        return found

    def handlers(self, node: str, kinds: Iterable[str]) -> dict[str, Callable[[Any], None]]:
        """Effect handlers for those of ``kinds`` that move blocks (``HANDBACKS``,
        ``QUARANTINE``): each tells the ledger where ``node``'s blocks of the effect's
        transfer went."""

        def give_back(kind: str) -> Callable[[Any], None]:
            return lambda effect: self.hand_back(self.blocks(node, effect.transfer_id), kind)

        found: dict[str, Callable[[Any], None]] = {}
        for kind in kinds:
            if kind in HANDBACKS:
                found[kind] = give_back(kind)
            elif kind == QUARANTINE:
                found[kind] = lambda effect: self.quarantine(self.blocks(node, effect.transfer_id))
        return found

    def post(self, what: str, source: Blocks, target: Blocks) -> Operation:
        """``what`` was posted: it may touch both blocks until ``settle``."""
        for blocks in (source, target):
            if not blocks.dead:
                self._record(posted(blocks.custody, what, owner=blocks.owner, left=blocks.left))
        op = Operation(what, source, target)
        self._ops.setdefault(id(source), []).append(op)
        self._ops.setdefault(id(target), []).append(op)
        return op

    def moved(self, op: Operation) -> None:
        """``op`` moves its bytes now."""
        for blocks in (op.source, op.target):
            if not blocks.dead:
                self._record(moved(blocks.custody, op.what, owner=blocks.owner, left=blocks.left))

    def settle(self, op: Operation) -> None:
        """``op`` can no longer touch its blocks."""
        if not op.in_flight:
            return
        op.in_flight = False
        for blocks in (op.source, op.target):
            ops = self._ops.get(id(blocks))
            if ops is not None:
                ops.remove(op)
                if not ops:
                    del self._ops[id(blocks)]

    def hand_back(self, blocks: Blocks, why: str) -> None:
        """The blocks go back to vLLM through effect ``why``."""
        if blocks.dead:
            return
        touching = next(
            (
                op.what
                for op in self._ops.get(id(blocks), ())
                if reaches(op.target is blocks, op.target.custody)
            ),
            "",
        )
        before = blocks.custody
        blocks.custody, violation = hand_back(
            before, why, touching, owner=blocks.owner, left=blocks.left
        )
        self._leave(blocks, before, why, violation)

    def quarantine(self, blocks: Blocks) -> None:
        if blocks.dead:
            return
        before = blocks.custody
        blocks.custody, violation = quarantine(before, owner=blocks.owner, left=blocks.left)
        self._leave(blocks, before, QUARANTINE, violation)

    def bury(self, node: str) -> None:
        """``node`` died: its memory went with it."""
        for (owner, _), blocks in self._blocks.items():
            if owner == node:
                blocks.dead = True

    def _leave(self, blocks: Blocks, before: int, why: str, violation: Violation | None) -> None:
        if before == HELD and blocks.custody != HELD:
            blocks.left = why
        self._record(violation)

    def _record(self, violation: Violation | None) -> None:
        if violation is None:
            return
        self.counts[violation.rule] += 1
        if self.keep is None or len(self.violations) < self.keep:
            self.violations.append(violation)
