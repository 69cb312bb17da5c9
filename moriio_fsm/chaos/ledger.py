"""The block ledger of a chaos run: whose blocks each transfer holds, which operations may
touch them, and the two ways that goes wrong, counted.

Rules: blocks go back (freed, or reported to vLLM) at most once, and never while an
operation writing into them may be in flight, nor (for a producer's blocks) while a
read from them may be, unless the blocks that read writes into are quarantined; no
operation is posted on blocks that went back. A rank that crashed is no longer judged:
its memory went with it. Nothing is raised: breaches are counted, the first few kept
with what happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: How many breaches of each kind are kept as text for the report.
KEPT = 20


@dataclass(eq=False)
class Blocks:
    """One rank's blocks of one transfer."""

    owner: str                          # "node/transfer", for messages
    gone: str = ""                      # why they went back; "" while held
    quarantined: bool = False
    dead: bool = False


@dataclass(eq=False)
class Operation:
    """One posted RDMA operation: it reads ``source`` and writes ``target``."""

    what: str
    source: Blocks
    target: Blocks
    in_flight: bool = True


@dataclass
class Ledger:
    double_handbacks: int = 0
    freed_in_flight: int = 0
    handbacks: int = 0
    examples: list[str] = field(default_factory=list)
    _blocks: dict[tuple[str, str], Blocks] = field(default_factory=dict)
    _ops: dict[int, list[Operation]] = field(default_factory=dict)   # id(Blocks) -> ops

    def blocks(self, node: str, transfer_id: str) -> Blocks:
        key = (node, transfer_id)
        found = self._blocks.get(key)
        if found is None:
            found = self._blocks[key] = Blocks(f"{node}/{transfer_id}")
        return found

    def post(self, what: str, source: Blocks, target: Blocks) -> Operation:
        for blocks in (source, target):
            if blocks.gone and not blocks.dead and not blocks.quarantined:
                self._breach("freed_in_flight", f"{what} posted on {blocks.owner} after its "
                                                f"blocks went back ({blocks.gone})")
        op = Operation(what, source, target)
        self._ops.setdefault(id(source), []).append(op)
        self._ops.setdefault(id(target), []).append(op)
        return op

    def settle(self, op: Operation) -> None:
        """``op`` can no longer touch its blocks."""
        if op.in_flight:
            op.in_flight = False
            for blocks in (op.source, op.target):
                ops = self._ops.get(id(blocks))
                if ops is not None:
                    ops.remove(op)
                    if not ops:
                        del self._ops[id(blocks)]

    def hand_back(self, blocks: Blocks, why: str) -> None:
        if blocks.dead:
            return
        if blocks.quarantined:
            if why != "reported_failure":    # a failed load of quarantined blocks frees nothing
                self._breach("double_handback", f"{blocks.owner}: {why} after the blocks were "
                                                "quarantined")
            return
        if blocks.gone:
            self._breach("double_handback", f"{blocks.owner}: blocks handed back twice "
                                            f"({blocks.gone}, then {why})")
            return
        touching = [op for op in self._ops.get(id(blocks), ())
                    if op.target is blocks or not op.target.quarantined]
        if touching:
            self._breach("freed_in_flight", f"{blocks.owner}: blocks handed back ({why}) while "
                                            f"{touching[0].what} may be in flight")
        blocks.gone = why
        self.handbacks += 1

    def quarantine(self, blocks: Blocks) -> None:
        if blocks.gone and not blocks.dead:
            self._breach("double_handback", f"{blocks.owner}: quarantined after its blocks "
                                            f"went back ({blocks.gone})")
        blocks.quarantined = True

    def bury(self, node: str) -> None:
        """``node`` crashed: its memory and its operations went with it."""
        for (owner, _), blocks in self._blocks.items():
            if owner == node:
                blocks.dead = True

    def _breach(self, kind: str, message: str) -> None:
        if kind == "double_handback":
            self.double_handbacks += 1
        else:
            self.freed_in_flight += 1
        if len(self.examples) < KEPT:
            self.examples.append(f"{kind}: {message}")
