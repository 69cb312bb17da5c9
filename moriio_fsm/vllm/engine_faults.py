"""Engine faults for fault runs: arm the engine's own fault rules from ``fault_injection``.

Rules: only engines that declare fault rules (``TransferEngine.faults``) take them; asking
another engine for them is a configuration error naming it. Control-message faults are
``message_faults.py``'s and need no engine rules. Random faults are seeded, so a run repeats.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping
from typing import Any

from ..engines.interface import TransferEngine
from .settings import ConnectorConfigError

#: The ``fault_injection`` keys the engine carries out.
ENGINE_FAULTS = ("fail_nth", "stall_nth", "drop_nth", "drop_all", "fail_rate", "latency_s")


def inject_faults(engine: TransferEngine, faults: Mapping[str, Any]) -> None:
    """Arm ``engine``'s fault rules from the ``fault_injection`` setting."""
    if not any(faults.get(name) for name in ENGINE_FAULTS):
        return
    rules = engine.faults
    if rules is None:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['fault_injection']: the "
            f"{type(engine).__name__} injects no faults; use the "
            "same_host backend"
        )
    for name, arm in (
        ("fail_nth", rules.fail_nth),
        ("stall_nth", rules.stall_nth),
        ("drop_nth", rules.drop_nth),
    ):
        if name in faults:
            arm(faults[name])
    if faults.get("drop_all"):
        rules.drop_when(lambda posted: True)
    if faults.get("fail_rate"):
        rules.fail_when(
            _unlucky(faults["fail_rate"], faults.get("seed", 0)),
            message="injected failure (fault_injection.fail_rate)",
        )
    if faults.get("latency_s"):
        rules.set_latency(faults["latency_s"], seed=faults.get("seed", 0))


def _unlucky(rate: float, seed: int):
    """A thread-safe test that holds with chance ``rate`` (a generator seeded with ``seed``)."""
    chance = random.Random(seed)
    lock = threading.Lock()

    def unlucky(posted) -> bool:
        with lock:
            return chance.random() < rate

    return unlucky
