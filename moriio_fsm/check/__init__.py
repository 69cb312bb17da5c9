"""The model checker: every state a machine (or a P/D pair of machines) can reach within
bounds, explored by running the real steps, with every rule checked along the way.

``check_machine(machine, bounds)`` explores one machine alone, handed every event of its
alphabet in every order (``single.py``); ``check_pair(mode, bounds)`` a producer and a
consumer over a faulty channel and engine (``pair.py``). Both return an ``Exploration``:
states, transitions, time, and per broken rule its shortest counterexample.
``docs/model-checking.md`` says what is explored and what each rule means.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..machines import build_machine
from ..runtime.machine import Machine
from .bounds import Bounds, CheckUsageError
from .explore import Exploration, Finding, Progress, search
from .pair import MODES, PairModel
from .single import MachineModel

__all__ = [
    "Bounds",
    "CheckUsageError",
    "Exploration",
    "Finding",
    "MODES",
    "check_machine",
    "check_pair",
    "check_spec",
]


def check_machine(
    machine: Machine,
    bounds: Bounds | None = None,
    *,
    domains: dict[str, tuple] | None = None,
    progress: Progress | None = None,
) -> Exploration:
    """Explore one machine within ``bounds`` (``domains`` replaces payload values by
    field name, see ``alphabet.py``)."""
    bounds = bounds or Bounds()
    model = MachineModel(machine, bounds, domains)
    result, _ = search(
        model, budget=bounds.peer_events, max_states=bounds.max_states, progress=progress
    )
    result.model = model
    return result


def check_spec(
    spec: str | Path,
    bounds: Bounds | None = None,
    *,
    config: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> Exploration:
    """``check_machine`` of a shipped spec (by name) or a spec file bound to the shipped
    bindings of its name."""
    return check_machine(build_machine(spec, config=config), bounds, progress=progress)


def check_pair(
    mode: str,
    bounds: Bounds | None = None,
    *,
    configs: dict[str, dict[str, Any]] | None = None,
    specs: dict[str, str] | None = None,
    machines: dict[str, Machine] | None = None,
    progress: Progress | None = None,
) -> Exploration:
    """Explore one P and one D rank of ``mode`` ("write" or "read") together. ``configs``
    overrides timeouts per machine; ``specs`` replaces a machine's spec by a file and
    ``machines`` a machine by one built already (with planted bindings, say)."""
    bounds = bounds or Bounds()
    model = PairModel(mode, bounds, configs=configs, specs=specs, machines=machines)
    result, _ = search(model, budget=bounds.faults, max_states=bounds.max_states, progress=progress)
    result.model = model
    return result
