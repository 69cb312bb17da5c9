"""Guards and actions bound to each spec, one module per spec, and the factory that
joins a spec file with its bindings into a runnable machine and transfer table.

``build_machine("write_producer")`` loads ``specs/write_producer.yaml``, imports
``moriio_fsm.machines.write_producer`` and checks that the two agree name for name.
"""

from __future__ import annotations

import functools
import importlib
import math
from pathlib import Path
from typing import Any

from ..lang.loader import load_spec
from ..lang.model import Spec

#: Specs that ship with the project, by name, and the module that binds each.
MACHINE_MODULES = {
    "write_producer": "moriio_fsm.machines.write_producer",
    "write_consumer": "moriio_fsm.machines.write_consumer",
    "read_producer": "moriio_fsm.machines.read_producer",
    "read_consumer": "moriio_fsm.machines.read_consumer",
}



def specs_dir() -> Path:
    """The folder holding the shipped spec files (package data: ``moriio_fsm/specs``)."""
    folder = Path(__file__).resolve().parent.parent / "specs"
    if not folder.is_dir():
        raise FileNotFoundError(f"the shipped specs are missing: {folder} is not a folder; "
                                "reinstall moriio-fsm")
    return folder


def spec_path(name: str) -> Path:
    return specs_dir() / f"{name}.yaml"


@functools.lru_cache(maxsize=32)
def _load_spec_cached(path: str, mtime_ns: int) -> Spec:
    # Keyed on the modification time, so an edited spec is read again.
    return load_spec(path)


def load_bindings(spec: Spec):
    """Import the bindings of ``spec`` by its name; a clear error when none exist."""
    module_name = MACHINE_MODULES.get(spec.name)
    if module_name is None:
        raise LookupError(f"{spec.path}: no machine module binds spec {spec.name!r}; known: "
                          f"{', '.join(sorted(MACHINE_MODULES))}")
    return importlib.import_module(module_name).bindings


def resolve_config(spec: Spec, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The spec's config defaults updated with ``overrides``.

    Every config value is a duration or a limit: it must be a positive, finite number
    (an integer where the default is one). Unknown keys and anything else raise
    ``ValueError`` naming the key and the value.
    """
    config = spec.default_config()
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"config overrides for machine {spec.name!r} must be a dict, got "
                         f"{type(overrides).__name__}")
    for key, value in (overrides or {}).items():
        if key not in config:
            raise ValueError(f"unknown config key {key!r} for machine {spec.name!r}; "
                             f"known keys: {', '.join(sorted(config))}")
        wants_int = isinstance(config[key], int)
        if (isinstance(value, bool) or not isinstance(value, int if wants_int else (int, float))
                or not math.isfinite(value) or value <= 0):
            raise ValueError(f"config key {key!r} of machine {spec.name!r} must be a positive, "
                             f"finite {'integer' if wants_int else 'number'}, got {value!r}")
        config[key] = value
    return config


def load_machine_spec(name_or_path: str | Path) -> Spec:
    """The spec of a shipped machine (by name) or of a spec file (by path), cached."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = spec_path(str(name_or_path))
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        mtime_ns = -1          # load_spec reports the unreadable file with its path
    return _load_spec_cached(str(path), mtime_ns)


def register_shipped_kinds() -> None:
    """Make the event and effect classes of every shipped spec (``events.<kind>`` and
    ``emits.<kind>`` then know them before any machine is built)."""
    from ..runtime.declared import register_spec

    for name in MACHINE_MODULES:
        register_spec(load_machine_spec(name))


def build_machine(name_or_path: str | Path, *, config: dict[str, Any] | None = None):
    """Load a spec (by shipped name or file path) and bind it to its guards and actions."""
    from ..runtime.machine import Machine

    spec = load_machine_spec(name_or_path)
    return Machine(spec, load_bindings(spec), resolve_config(spec, config))


def build_table(name_or_path: str | Path = "write_producer", *, executor: str = "compiled",
                config: dict[str, Any] | None = None, **table_options):
    """A ``TransferTable`` for one machine. ``executor`` is ``"compiled"`` (generated
    steps, the hot path) or ``"transitions"`` (pytransitions, the reference semantics,
    for debugging); ``table_options`` go to ``TransferTable``."""
    from ..runtime.table import TransferTable

    return TransferTable(build_machine(name_or_path, config=config), executor=executor,
                         **table_options)
