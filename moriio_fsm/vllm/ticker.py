"""The timer thread: fires the machines' due deadlines every ``tick_interval`` seconds.

Rules: a deadline is the machines' business; this thread only asks each driver to advance
its clock and hands what ran to ``settled``. A step that raises is logged and the thread goes
on, so one broken transfer never stops every other transfer's timers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from ..logs import get_logger
from ..runtime.driver import Driver

log = get_logger("moriio_fsm.vllm")


class Ticker:
    """Advances ``drivers`` on a daemon thread until ``stop``."""

    def __init__(
        self, drivers: Mapping[str, Driver], settled: Callable[[str, list], None], interval_s: float
    ):
        self._drivers = drivers
        self._settled = settled
        self._interval = interval_s
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moriio-fsm-timers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            for side, driver in list(self._drivers.items()):
                try:
                    self._settled(side, driver.advance())
                except Exception:
                    log.exception("vllm.timer_step_failed", side=side)
            time.sleep(self._interval)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop after the current round; waits for it at most ``timeout_s``."""
        self._stopping = True
        self._thread.join(timeout=timeout_s)
