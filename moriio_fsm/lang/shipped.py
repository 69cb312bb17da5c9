"""The specs that ship inside the package (``moriio_fsm/specs``): their names, their
files, and loading one by name or by path.

Rules: a spec is read once per modification of its file (an edited spec is read again);
a missing specs folder is an error that says to reinstall, not an empty list.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .loader import load_spec
from .model import Spec

#: The shipped specs, by name (each has ``specs/<name>.yaml`` and a bindings module of the
#: same name in ``moriio_fsm.machines``).
SHIPPED_SPECS = ("write_producer", "write_consumer", "read_producer", "read_consumer")


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
