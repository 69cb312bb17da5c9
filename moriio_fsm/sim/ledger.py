"""The block ledger: who owns each transfer's blocks, and every rule about them, checked.

Rules it enforces (each breach is recorded as a violation, never raised): blocks go back
(free, report to vLLM) at most once per side and transfer, never while a write or read
from or into them is in flight, and no write or read touches blocks after they went
back. Quarantined blocks never go back. A side whose process died stops being judged:
its memory is gone with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Blocks:
    """One side's blocks of one transfer (a P rank's source or a D rank's target)."""

    owner: str                         # "node/transfer" for messages
    in_flight: int = 0                 # posted operations that may still touch them
    gone: str = ""                     # why they went back ("" while still held)
    quarantined: bool = False
    dead: bool = False


@dataclass
class Ledger:
    violations: list[str] = field(default_factory=list)
    blocks: dict[tuple[str, str], Blocks] = field(default_factory=dict)
    handbacks: int = 0

    def of(self, node: str, transfer_id: str) -> Blocks:
        key = (node, transfer_id)
        found = self.blocks.get(key)
        if found is None:
            found = self.blocks[key] = Blocks(f"{node}/{transfer_id}")
        return found

    def start(self, blocks: Blocks, what: str) -> None:
        """An operation from or into ``blocks`` was posted."""
        if blocks.gone and not blocks.dead:
            self.violations.append(f"{what} posted on {blocks.owner} after its blocks went back "
                                   f"({blocks.gone})")
        blocks.in_flight += 1

    def touch(self, blocks: Blocks, what: str) -> None:
        """An operation moves bytes from or into ``blocks`` now."""
        if blocks.gone and not blocks.dead and not blocks.quarantined:
            self.violations.append(f"{what} touched {blocks.owner} after its blocks went back "
                                   f"({blocks.gone})")

    def finish(self, blocks: Blocks) -> None:
        """An operation from or into ``blocks`` can no longer touch them."""
        blocks.in_flight -= 1

    def hand_back(self, blocks: Blocks, why: str) -> None:
        """The blocks go back to vLLM (freed, or reported as loaded or failed)."""
        if blocks.dead:
            return
        if blocks.quarantined:
            return                     # a failure report for quarantined blocks frees nothing
        if blocks.gone:
            self.violations.append(f"{blocks.owner}: blocks handed back twice ({blocks.gone}, then {why})")
            return
        if blocks.in_flight:
            self.violations.append(f"{blocks.owner}: blocks handed back ({why}) with "
                                   f"{blocks.in_flight} operation(s) in flight")
        blocks.gone = why
        self.handbacks += 1

    def quarantine(self, blocks: Blocks) -> None:
        if blocks.gone and not blocks.dead:
            self.violations.append(f"{blocks.owner}: quarantined after its blocks went back ({blocks.gone})")
        blocks.quarantined = True

    def bury(self, node: str) -> None:
        """``node`` died: its memory went with it."""
        for (owner, _), blocks in self.blocks.items():
            if owner == node:
                blocks.dead = True
