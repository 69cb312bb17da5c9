"""Loading mori's real Python layer (``mori``, ``mori.io``) from the pinned wheel over the stand-in ``mori.cpp``.

Rules: only an explicit call loads it (tests, benchmarks), never an import of this package; it never shadows a mori
whose ``mori.io`` imports for real, in a child interpreter or in this process (refused: ``StandInRefused``); it
says at start, in every line it logs, that ``mori.cpp`` is a stand-in; ``unload`` takes every ``mori`` module out
of ``sys.modules`` again.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

from ...errors import MoriioFsmError
from .engine import FAULTS
from .module import make_module
from .wheel import PINNED_VERSION, python_layer

__all__ = ["StandInRefused", "is_loaded", "load_mori_io", "unload"]

_log = logging.getLogger("moriio_fsm.engines.mori_standin")
_lock = threading.Lock()
_PROBE_TIMEOUT_S = 120.0


class StandInRefused(MoriioFsmError, RuntimeError):
    """The stand-in will not load here; the message says why."""


def is_loaded() -> bool:
    """Whether ``sys.modules["mori.cpp"]`` is this stand-in."""
    return bool(getattr(sys.modules.get("mori.cpp"), "__standin__", False))


def load_mori_io(cache: Path | None = None) -> types.ModuleType:
    """The wheel's ``mori.io`` over the stand-in ``mori.cpp``, loaded into ``sys.modules`` (once).

    Raises ``WheelUnavailable`` when pip cannot fetch the pinned wheel, ``WheelMismatch`` for a wheel that is
    not the pinned one, ``StandInRefused`` where a real mori imports or another mori is already imported, or
    ``MORI_PRECOMPILE`` asks mori to compile GPU kernels at import.
    """
    with _lock:
        if is_loaded():
            return importlib.import_module("mori.io")
        _refuse_to_shadow()
        layer = python_layer(cache)
        faults = os.environ.get("MORI_STANDIN_FAULTS", "")
        if faults:
            FAULTS.inject_from_json(faults)
        _install(layer)
        io = importlib.import_module("mori.io")
    _log.warning(
        "[mori stand-in] mori.cpp is a STAND-IN (moriio_fsm.engines.mori_standin), not AMD's native mori: "
        "host memory only, bytes moved over TCP between stand-in engines (memmove within one process); "
        "mori.io is amd-mori %s's own Python layer from %s%s",
        PINNED_VERSION,
        layer,
        f"; injected faults: {faults}" if faults else "",
    )
    return io


def _refuse_to_shadow() -> None:
    if os.environ.get("MORI_PRECOMPILE", "").lower() in ("1", "true", "on"):
        raise StandInRefused(
            "MORI_PRECOMPILE is set: importing mori would compile GPU kernels; unset it to load "
            "the mori stand-in"
        )
    if "mori.io" in sys.modules:
        raise StandInRefused(
            f"mori.io is already imported here ({sys.modules['mori.io'].__file__!r}); the "
            "stand-in never replaces it"
        )
    try:
        spec = importlib.util.find_spec("mori")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return
    if _imports_for_real():
        raise StandInRefused(
            f"mori.io imports for real here (from {spec.origin}); use it, not the stand-in"
        )
    # A mori whose io layer does not import (its native libraries fail): what an earlier attempt left is dropped.
    if "mori" in sys.modules:
        _log.warning(
            "[mori stand-in] the mori at %s does not import mori.io here; the stand-in replaces what of "
            "it was imported",
            spec.origin,
        )
        unload()


def _imports_for_real() -> bool:
    """Whether ``import mori.io`` succeeds in a child interpreter (a native crash there cannot hurt us)."""
    try:
        child = subprocess.run(
            [sys.executable, "-c", "import mori.io"], capture_output=True, timeout=_PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return child.returncode == 0


def _install(layer: Path) -> None:
    """Put the wheel's ``mori`` package in ``sys.modules`` with the stand-in as its ``cpp``."""
    package_dir = layer / "mori"
    spec = importlib.util.spec_from_file_location(
        "mori", package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
    )
    if spec is None or spec.loader is None:
        raise StandInRefused(f"{package_dir} is not a mori package")
    package = importlib.util.module_from_spec(spec)
    native = make_module()
    sys.modules["mori"] = package
    sys.modules["mori.cpp"] = native
    try:
        spec.loader.exec_module(package)
        package.cpp = native  # type: ignore[attr-defined]
    except BaseException:
        unload()
        raise


def unload() -> None:
    """Take the wheel's ``mori`` modules and the stand-in out of ``sys.modules`` (engines made keep theirs)."""
    for name in [name for name in sys.modules if name == "mori" or name.startswith("mori.")]:
        del sys.modules[name]
