"""Loading a shipped spec by its machine's name, or a spec by path, cached; the shipped
specs' names and files are ``shipped_files.py``'s, re-exported here.

Rules: a spec is read once per modification of its file (an edited spec is read again).
"""

from __future__ import annotations

import functools
from pathlib import Path

from .loader import load_spec
from .model import Spec
from .shipped_files import SHIPPED_SPECS, spec_path, specs_dir

__all__ = ["SHIPPED_SPECS", "load_machine_spec", "spec_path", "specs_dir"]


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
        mtime_ns = -1  # load_spec reports the unreadable file with its path
    return _load_spec_cached(str(path), mtime_ns)
