"""Whether NIXL (PyPI ``nixl``) can be used in this process, and its Python API once it can.

Rules: ``probe_nixl`` never raises and never crashes this process (``isolated`` tries the import in a child first);
``nixl`` is imported here and nowhere else; NIXL's own logger is moved off stdout, which belongs to the program.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from ...errors import MoriioFsmError

__all__ = ["NixlAvailability", "NixlUnavailableError", "nixl_api", "probe_nixl"]


class NixlUnavailableError(MoriioFsmError, RuntimeError):
    """NIXL cannot be used in this process; the message says why."""


@dataclass(frozen=True, slots=True)
class NixlAvailability:
    available: bool
    reason: str


_probe_lock = threading.Lock()
_probe_result: NixlAvailability | None = None


def probe_nixl(*, isolated: bool = False, timeout_s: float = 60.0) -> NixlAvailability:
    """Whether ``nixl`` imports here; the answer is cached for the process.

    A missing package raises ``ImportError`` (so does a ``nixl`` without any of its
    per-platform sub-wheels), native libraries that do not load raise ``OSError``, and a
    broken install may raise anything while importing: each becomes the reason string.
    With ``isolated=True`` the import is first tried in a child interpreter, so a native
    crash there cannot take this process down.
    """
    global _probe_result
    with _probe_lock:
        if _probe_result is not None:
            return _probe_result
        if isolated:
            try:
                child = subprocess.run([sys.executable, "-c", "import nixl._api"],
                                       capture_output=True, text=True, timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired) as exc:
                _probe_result = NixlAvailability(False, f"probing nixl in a child failed: {exc}")
                return _probe_result
            if child.returncode != 0:
                last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
                _probe_result = NixlAvailability(False, f"nixl does not import: {last}")
                return _probe_result
        try:
            importlib.import_module("nixl._api")
        except ImportError as exc:
            _probe_result = NixlAvailability(
                False, f"nixl is not installed or has no platform wheel ({exc}); "
                       "install it with `pip install nixl==1.5.1` (the `nixl` extra)")
        except OSError as exc:
            _probe_result = NixlAvailability(False, f"nixl's native libraries failed to load: {exc}")
        except Exception as exc:  # a broken install can raise anything while importing
            _probe_result = NixlAvailability(
                False, f"nixl failed while importing: {type(exc).__name__}: {exc}")
        else:
            _quiet_stdout_logging()
            _probe_result = NixlAvailability(True, "nixl imported")
        return _probe_result


def nixl_api() -> Any:
    """The ``nixl._api`` module; raises ``NixlUnavailableError`` saying why it cannot be had."""
    availability = probe_nixl()
    if not availability.available:
        raise NixlUnavailableError(availability.reason)
    return importlib.import_module("nixl._api")


def _quiet_stdout_logging() -> None:
    """Send NIXL's Python log to stderr, at WARNING unless ``NIXL_LOG_LEVEL`` asks otherwise.

    nixl configures its logger with a handler on sys.stdout at INFO (a line per agent and
    backend): in a server whose stdout is a protocol, or a peer speaking JSON lines, those
    lines would corrupt it.
    """
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)
