"""The bounds a model-checking run explores within, checked once, with clear errors.

Rules: every bound is a small positive integer (or, for ``tick_s``, a positive number of
seconds or None); a bad value raises ``CheckUsageError`` naming the bound and what was
expected. Bounds limit the world, never the machine: a run never cuts a step short.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from ..errors import MoriioFsmError

#: The words Bounds.tick_s takes besides a number of seconds.
TICK_MODES = ("default", "auto", "off")


class CheckUsageError(MoriioFsmError, ValueError):
    """The checker was asked for something it cannot do (a bad bound, an unknown spec)."""


@dataclass(frozen=True)
class Bounds:
    """How big a world to explore.

    ``layers``: layers per transfer (events name layers 0..layers-1). ``writers``: ranks
    on the other side (writer and consumer counts 1..writers, ranks -1..writers-1).
    ``peer_events``: how many events from the peer or this side's adapters one run may
    see, duplicates included (local events, timers and time are free). ``faults`` (pairs
    only): messages lost or duplicated, handlers that raise, operations that fail.
    ``tick_s``: how time moves when no timer is due. A number: also in steps of that
    many seconds between deadlines, so events can come at any such instant; "auto": in
    steps of the greatest common divisor of the timer durations; "off": from deadline
    to deadline only; "default": what the model picks ("off" for one machine, whose
    events all come at instants a timer can fire, "auto" for pairs, where message
    delays between the sides matter).
    ``max_states``: a run that finds more states stops and says so.
    """

    layers: int = 2
    writers: int = 1
    peer_events: int = 4
    faults: int = 2
    tick_s: float | str = "default"
    max_states: int = 2_000_000

    def __post_init__(self) -> None:
        for name, low, high in (
            ("layers", 1, 16),
            ("writers", 1, 8),
            ("peer_events", 0, 64),
            ("faults", 0, 16),
            ("max_states", 1, 100_000_000),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise CheckUsageError(
                    f"bound {name} must be an integer in [{low}, {high}], got {value!r}"
                )
        tick = self.tick_s
        if tick not in TICK_MODES and (
            isinstance(tick, bool)
            or not isinstance(tick, (int, float))
            or not math.isfinite(tick)
            or tick <= 0
        ):
            raise CheckUsageError(
                f"bound tick_s must be a number of seconds > 0 or one of "
                f"{', '.join(TICK_MODES)}, got {tick!r}"
            )

    def with_(self, **changes: Any) -> Bounds:
        return replace(self, **changes)

    def tick_for(self, durations: Iterable[float], default: str) -> float | None:
        """The time step to explore with (None: deadlines only), given the timer
        durations of the machines and the model's default mode."""
        tick = default if self.tick_s == "default" else self.tick_s
        if tick == "off":
            return None
        if tick == "auto":
            return common_step(durations)
        return float(tick)


def common_step(durations: Iterable[float]) -> float | None:
    """The greatest step that divides every duration (to the millisecond), or None when
    there are none. Durations of 30 and 10 seconds give 10; 0.5 and 0.3 give 0.1."""
    step: Fraction | None = None
    for duration in durations:
        value = Fraction(round(float(duration) * 1000), 1000)
        if value <= 0:
            continue
        step = value if step is None else _gcd(step, value)
    return None if step is None else float(step)


def _gcd(a: Fraction, b: Fraction) -> Fraction:
    # gcd of two rationals: gcd of numerators over lcm of denominators
    numerator = math.gcd(a.numerator * b.denominator, b.numerator * a.denominator)
    return Fraction(numerator, a.denominator * b.denominator)
