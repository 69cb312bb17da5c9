"""Guards and effects bound to each spec, one module per spec, and the factory that
joins a spec file with its bindings into a runnable machine and transfer table.

``build_machine("write_producer")`` loads ``specs/write_producer.yaml``, imports
``moriio_fsm.machines.write_producer`` and checks that the two agree name for name.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

from ..lang.loader import load_spec
from ..lang.model import Spec

#: Specs that ship with the project, by name, and the module that binds each.
MACHINE_MODULES = {
    "write_producer": "moriio_fsm.machines.write_producer",
}

ENGINES = ("compiled", "transitions")


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
    """The spec's config defaults updated with ``overrides``; unknown keys are refused."""
    config = spec.default_config()
    for key, value in (overrides or {}).items():
        if key not in config:
            raise ValueError(f"unknown config key {key!r} for machine {spec.name!r}; "
                             f"known keys: {', '.join(sorted(config))}")
        default = config[key]
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"config key {key!r} of machine {spec.name!r} must be a positive "
                                 f"number, got {value!r}")
        config[key] = value
    return config


def build_machine(name_or_path: str | Path, *, engine: str = "compiled",
                  config: dict[str, Any] | None = None):
    """Load a spec (by shipped name or file path) and compile it with its bindings.

    ``engine`` is ``"compiled"`` (the table-driven hot path) or ``"transitions"``
    (pytransitions, the reference semantics, for debugging).
    """
    from ..runtime.compiled import CompiledMachine
    from ..runtime.reference import TransitionsMachine

    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = spec_path(str(name_or_path))
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        mtime_ns = -1          # load_spec reports the unreadable file with its path
    spec = _load_spec_cached(str(path), mtime_ns)
    bindings = load_bindings(spec)
    cls = CompiledMachine if engine == "compiled" else TransitionsMachine
    return cls(spec, bindings, resolve_config(spec, config))


def build_table(name_or_path: str | Path = "write_producer", *, engine: str = "compiled",
                config: dict[str, Any] | None = None, **table_options):
    """A ``TransferTable`` for one machine; ``table_options`` go to ``TransferTable``."""
    from ..runtime.table import TransferTable

    return TransferTable(build_machine(name_or_path, engine=engine, config=config), **table_options)
