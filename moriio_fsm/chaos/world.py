"""What every part of a chaos run shares: the virtual clock and its queue of actions, the
seeded generator, the block ledger, where each transfer runs, and the ranks by name.

Rules: actions run in time order, ties in the order they were scheduled, and the clock
moves only to the next action or tick; one seeded generator decides everything random,
so a seed replays the same run. A rank joins with how to hand it an event; a crashed rank
is no longer alive, and the ledger no longer judges its blocks.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

from ..adapters.zmq import Role
from ..ledger import Ledger
from ..runtime.events import Event
from .settings import ChaosSettings

#: How many breaches of the block rules are kept as text for the report.
KEPT = 20


class World:
    """The state of one run of ``settings``; ``specs`` runs a machine from another spec
    file (machine name -> path)."""

    def __init__(self, settings: ChaosSettings, specs: dict[str, str] | None = None):
        self.settings = settings
        self.specs = dict(specs or {})
        self.rng = random.Random(settings.seed)
        self.now = 0.0
        self.ledger = Ledger(keep=KEPT)
        self.mode_of: dict[str, str] = {}  # transfer -> "write" | "read"
        self.placement: dict[str, tuple[str, str]] = {}  # transfer -> (P rank, D rank)
        self._queue: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._roles: dict[str, Role] = {}
        self._inboxes: dict[str, Callable[[Event], None]] = {}
        self._crashed: set[str] = set()

    # -- the clock ---------------------------------------------------------------------------

    def at(self, delay: float, action: Callable[[], object]) -> None:
        """Run ``action`` ``delay`` virtual seconds from now."""
        self.at_time(self.now + max(0.0, delay), action)

    def at_time(self, when: float, action: Callable[[], object]) -> None:
        heapq.heappush(self._queue, (when, next(self._seq), action))

    def run_until(self, until: float, tick_s: float, tick: Callable[[float], None]) -> None:
        """Run every action due by ``until``, calling ``tick(now)`` every ``tick_s`` and
        once more at ``until``."""
        next_tick = 0.0
        queue = self._queue
        while True:
            due = queue[0][0] if queue else until
            if next_tick <= due and next_tick <= until:
                self.now = next_tick
                tick(next_tick)
                next_tick += tick_s
                continue
            if due > until or not queue:
                self.now = until
                tick(until)
                return
            self.now, _, action = heapq.heappop(queue)
            action()

    # -- the ranks ---------------------------------------------------------------------------

    def join(self, name: str, role: Role, deliver: Callable[[Event], None]) -> None:
        self._roles[name] = role
        self._inboxes[name] = deliver

    def deliver(self, name: str, event: Event) -> None:
        """Hand ``event`` to rank ``name`` (which drops it when it crashed)."""
        self._inboxes[name](event)

    def alive(self, name: str) -> bool:
        return name not in self._crashed

    def role_of(self, name: str) -> Role:
        return self._roles[name]

    def live(self, role: Role) -> list[str]:
        """The ranks of ``role`` still alive, by name."""
        return [
            name
            for name in sorted(self._roles)
            if self._roles[name] is role and name not in self._crashed
        ]

    def crash(self, name: str) -> None:
        """Rank ``name``'s process died, its memory with it."""
        self._crashed.add(name)
        self.ledger.bury(name)
