"""Guards and actions bound to each spec, one module per spec, the factory that joins a
spec file with its bindings into a runnable machine and transfer table, and the resolution
of machines' configs: each against its spec, and those that run together against the
bounds between them.

``build_machine("write_producer")`` loads ``specs/write_producer.yaml``, imports
``moriio_fsm.machines.write_producer`` and checks that the two agree name for name.
This package imports the runtime and the spec language; neither imports it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..lang.bounds import ConfigBoundError, broken_bounds
from ..lang.model import Spec
from ..lang.shipped import SHIPPED_SPECS, load_machine_spec, spec_path, specs_dir
from ..runtime.machine import Machine
from ..runtime.table import TransferTable

__all__ = [
    "MACHINE_MODULES",
    "ConfigBoundError",
    "build_machine",
    "build_table",
    "check_config_bounds",
    "load_bindings",
    "load_machine_spec",
    "resolve_config",
    "spec_path",
    "specs_dir",
]

#: Specs that ship with the project, by name, and the module that binds each.
MACHINE_MODULES = {name: f"moriio_fsm.machines.{name}" for name in SHIPPED_SPECS}


def load_bindings(spec: Spec):
    """Import the bindings of ``spec`` by its name; a clear error when none exist."""
    module_name = MACHINE_MODULES.get(spec.name)
    if module_name is None:
        raise LookupError(
            f"{spec.path}: no machine module binds spec {spec.name!r}; known: "
            f"{', '.join(sorted(MACHINE_MODULES))}"
        )
    return importlib.import_module(module_name).bindings


def resolve_config(spec: Spec, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The spec's config defaults updated with ``overrides``.

    Every config value is a duration or a limit: it must be a positive, finite number
    (an integer where the default is one). Unknown keys and anything else raise
    ``ValueError`` naming the key and the value.
    """
    config = spec.default_config()
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(
            f"config overrides for machine {spec.name!r} must be a dict, got "
            f"{type(overrides).__name__}"
        )
    for key, value in (overrides or {}).items():
        if key not in config:
            raise ValueError(
                f"unknown config key {key!r} for machine {spec.name!r}; "
                f"known keys: {', '.join(sorted(config))}"
            )
        wants_int = isinstance(config[key], int)
        if (
            isinstance(value, bool)
            or not isinstance(value, int if wants_int else (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(
                f"config key {key!r} of machine {spec.name!r} must be a positive, "
                f"finite {'integer' if wants_int else 'number'}, got {value!r}"
            )
        config[key] = value
    return config


def check_config_bounds(configs: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse the configs of machines that run together if they break a bound of the specs
    (a key's ``exceeds``).

    ``configs`` maps shipped machine names to their resolved configs (``resolve_config``);
    every bound whose machines are all among them is checked. ``ConfigBoundError`` lists
    each broken bound: both machines' keys, their values and the sum to exceed.
    """
    unknown = sorted(set(configs) - set(MACHINE_MODULES))
    if unknown:
        raise ValueError(
            f"unknown machine(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(MACHINE_MODULES)}"
        )
    broken = broken_bounds({name: load_machine_spec(name) for name in configs}, configs)
    if broken:
        raise ConfigBoundError(broken)


def build_machine(name_or_path: str | Path, *, config: dict[str, Any] | None = None):
    """Load a spec (by shipped name or file path) and bind it to its guards and actions."""
    spec = load_machine_spec(name_or_path)
    return Machine(spec, load_bindings(spec), resolve_config(spec, config))


def build_table(
    name_or_path: str | Path = "write_producer",
    *,
    executor: str = "compiled",
    config: dict[str, Any] | None = None,
    **table_options,
):
    """A ``TransferTable`` for one machine. ``executor`` is ``"compiled"`` (generated
    steps, the hot path) or ``"transitions"`` (pytransitions, the reference semantics,
    for debugging); ``table_options`` go to ``TransferTable``."""
    return TransferTable(
        build_machine(name_or_path, config=config), executor=executor, **table_options
    )
