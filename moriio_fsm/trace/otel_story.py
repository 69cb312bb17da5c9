"""What one transfer's OpenTelemetry spans are made of, handed from the recorder (``otel_spans.py``)
to the exporter (``otel_export.py``), and the clock conversion both use.

Rules: plain data, no OpenTelemetry import; times are the machines' monotonic seconds until the
exporter turns them into epoch nanoseconds with ``wall_ns``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TransferStory:
    """What one transfer's spans are made of: its states with their start times, and notes."""

    machine: str
    key: str
    side: str
    states: list[tuple[str, float]]  # (state, entered at: monotonic seconds)
    anomalies: list[str] = field(default_factory=list)
    outcome: str = ""
    end: float = 0.0
    request_id: str = ""
    headers: dict[str, str] | None = None

    @property
    def role(self) -> str:
        """``producer`` (P) or ``consumer`` (D), from the machine's name."""
        return "producer" if self.machine.endswith("producer") else "consumer"


#: Wall clock minus monotonic clock, read once: the machines' times are monotonic.
_WALL_OFFSET = time.time() - time.monotonic()


def wall_ns(monotonic_s: float) -> int:
    """Epoch nanoseconds of a monotonic reading (the machines' clock)."""
    return int((monotonic_s + _WALL_OFFSET) * 1e9)
