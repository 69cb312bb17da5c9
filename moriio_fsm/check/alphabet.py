"""The concrete events a machine may be handed within bounds: its alphabet.

Rules: every event kind the spec declares is in the alphabet with every combination of
payload values drawn from small domains, chosen by field name (``layer`` takes
0..layers-1, ranks -1..writers-1, ...) or, for a name not listed, by declared type.
Timer events are not in it: they come from armed deadlines only. Creating events are
listed apart too, as the ways a transfer can start (and again among the others, as
duplicates). What an event costs against the
``peer_events`` bound follows its declared origin: the peer's and the adapters' cost
one, the host's are free (the host's request lifecycle always ends).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..lang.model import Spec
from ..runtime.declared import make_event
from ..runtime.events import Event
from .bounds import Bounds

#: Payload values by field name. Ranks include -1 (a sender that gives none) and counts
#: start at 1; block lists hold one block, or none where "nothing to load" means something.
NAMED_DOMAINS: dict[str, Callable[[Bounds], tuple]] = {
    "layer": lambda b: tuple(range(b.layers)),
    # Layer sets as bitmaps: each layer alone, all of them, and the even ones (a set that
    # leaves some out), not every subset: those grow as 2**layers.
    "layers": lambda b: tuple(
        sorted(
            {1 << layer for layer in range(b.layers)}
            | {(1 << b.layers) - 1, int("01" * b.layers, 2) & ((1 << b.layers) - 1)}
        )
    ),
    "num_layers": lambda b: (b.layers,),
    "num_writers": lambda b: tuple(range(1, b.writers + 1)),
    "consumer_tp_size": lambda b: tuple(range(1, b.writers + 1)),
    "producer_rank": lambda b: tuple(range(-1, b.writers)),
    "consumer_rank": lambda b: tuple(range(-1, b.writers)),
    "decode_rank": lambda b: (0, -1),
    "block_ids": lambda b: ([7], []),
    "remote_block_ids": lambda b: ([7],),
    "writes_stopped": lambda b: (True, False),
    "seq": lambda b: (1, 2, 3),
    # A lease that covers the reads (P's default) and one that runs out at once.
    "lease_s": lambda b: (30.0, 0.0),
    "code": lambda b: (13,),
    "reason": lambda b: ("failed",),
    "error": lambda b: ("injected",),
    # Unknown, and two prompts: enough to meet an allocation made for another prompt.
    "prompt_digest": lambda b: ("", "a", "b"),
    # Unknown, and two engines of D.
    "decode_dp_rank": lambda b: (-1, 0, 1),
}

#: Payload values by declared type, for field names not listed above.
TYPE_DOMAINS: dict[str, tuple] = {
    "int": (0,),
    "float": (1.0,),
    "str": ("",),
    "bool": (True, False),
    "list": ([7],),
    "tuple": ((),),
    "any": (None,),
}

#: Origins whose events count against Bounds.peer_events.
COSTLY_ORIGINS = frozenset({"remote", "adapter"})


@dataclass(frozen=True)
class Concrete:
    """One concrete event: a kind with its payload values."""

    kind: str
    data: tuple[tuple[str, Any], ...]
    origin: str

    @property
    def cost(self) -> int:
        return 1 if self.origin in COSTLY_ORIGINS else 0

    def build(self, transfer_id: str, now: float, source: str = "") -> Event:
        return make_event(self.kind, transfer_id, now, dict(self.data), source=source)

    def __str__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in self.data)
        return f"{self.kind}({args})"


def payload_domain(
    field: str, type_name: str, bounds: Bounds, overrides: dict[str, tuple] | None = None
) -> tuple:
    """The values one payload field takes within ``bounds``."""
    if overrides and field in overrides:
        return tuple(overrides[field])
    named = NAMED_DOMAINS.get(field)
    if named is not None:
        return named(bounds)
    return TYPE_DOMAINS[type_name]


def concrete_events(
    spec: Spec, kind: str, bounds: Bounds, overrides: dict[str, tuple] | None = None
) -> list[Concrete]:
    """Every concrete event of ``kind``, one per combination of payload values."""
    declared = spec.events[kind]
    names = list(declared.payload)
    domains = [payload_domain(n, declared.payload[n], bounds, overrides) for n in names]
    return [
        Concrete(kind, tuple(zip(names, values)), declared.origin)
        for values in itertools.product(*domains)
    ]


class Alphabet:
    """The creating events and the other non-timer events of one spec, within bounds."""

    def __init__(self, spec: Spec, bounds: Bounds, overrides: dict[str, tuple] | None = None):
        timer_events = {timer.event for timer in spec.timers.values()}
        self.creating: list[Concrete] = []
        self.events: list[Concrete] = []
        for kind, declared in spec.events.items():
            if kind in timer_events:
                continue
            found = concrete_events(spec, kind, bounds, overrides)
            if declared.creates:
                self.creating.extend(found)
            self.events.extend(found)

    def __len__(self) -> int:
        return len(self.events)
