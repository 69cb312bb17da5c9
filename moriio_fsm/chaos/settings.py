"""What one chaos run is: how many transfers, which seed, how often each fault strikes, and
the machines' timeouts on its virtual clock.

Rules: every setting is checked once, here, and a bad one raises ``ChaosUsageError``
naming it and what was expected. The timeouts are the shipped specs' scaled down (a run
spans minutes of virtual time, not hours) with their order kept: P's longest drain under
D's safety timeout, the read budget and margin under the lease, a teardown under the
margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import MoriioFsmError
from ..sim.pd import CONFIG as SIMULATED_TIMEOUTS


class ChaosUsageError(MoriioFsmError, ValueError):
    """A chaos run was asked for with a setting it cannot take."""


#: The machines' timeouts on the run's virtual clock (seconds): the joint P/D
#: simulation's, scaled down the same way for the same reason.
CONFIG = SIMULATED_TIMEOUTS


@dataclass(frozen=True)
class ChaosSettings:
    """``transfers`` of both modes (even ones WRITE, odd ones READ) between ``producers``
    P ranks and ``consumers`` D ranks, ``layers`` each, started ``spacing_s`` apart on
    average. ``fault_rate`` is the chance of each fault at each chance it has: a message
    lost, duplicated or delayed (and so reordered), an RDMA operation failed or stalled
    for good, a teardown never answered, a request aborted; with any faults at all, one
    rank crashes once, at a time the seed picks."""

    transfers: int = 1000
    seed: int = 0
    fault_rate: float = 0.05
    layers: int = 4
    producers: int = 2
    consumers: int = 2
    spacing_s: float = 0.01

    def __post_init__(self) -> None:
        for name, low, high in (
            ("transfers", 1, 10_000_000),
            ("layers", 1, 64),
            ("producers", 1, 16),
            ("consumers", 1, 16),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ChaosUsageError(
                    f"{name} must be an integer in [{low}, {high}], got {value!r}"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ChaosUsageError(f"seed must be an integer, got {self.seed!r}")
        rate = self.fault_rate
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or not 0 <= rate <= 0.5
        ):
            raise ChaosUsageError(f"fault_rate must be a number in [0, 0.5], got {rate!r}")
        spacing = self.spacing_s
        if (
            isinstance(spacing, bool)
            or not isinstance(spacing, (int, float))
            or not math.isfinite(spacing)
            or spacing <= 0
        ):
            raise ChaosUsageError(f"spacing_s must be a number of seconds > 0, got {spacing!r}")
