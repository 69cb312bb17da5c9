"""What a worker waits for between vLLM's steps, so the engine loop does not spin on a busy core.

Rules: vLLM's engine loop asks for finished transfers without pause while a request waits
for its KV. On a step with no forward while a WRITE load is pending, D helps with its peers'
writes into this engine (copy assist) instead of spinning; other steps do not, since their
core is the forward's. An engine copying inline shares this core with the loop, so a copy
in flight is let end; with cores to spare, waiting would only delay other requests' steps.
How long each wait lasts is the engine's tuning, and a load that ends ends it at once
(``VllmReports.on_load_ended``).
"""

from __future__ import annotations

from typing import Any

from .reports import VllmReports


def wait_between_steps(
    engine: Any, reports: VllmReports, *, idle_step: bool, writes_in: bool
) -> None:
    """Wait as this step allows: help writers on an idle step with a load pending
    (``writes_in``: peers write into this engine, WRITE mode), then let inline copies end."""
    if engine is None:
        return
    if idle_step and writes_in and reports.loads_pending():
        engine.help_writers()
    if engine.inline_copies:
        engine.wait_for_copies()
