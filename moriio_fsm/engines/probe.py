"""Whether an optional native package (mori.io, nixl) can be used in this process, asked once.

Rules: a probe never raises and never crashes this process (``isolated`` tries the import in a child first);
whatever the import raises becomes the reason string; the answer is cached for the process.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Availability", "ImportProbe"]


@dataclass(frozen=True, slots=True)
class Availability:
    available: bool
    reason: str


class ImportProbe:
    """``probe()`` says whether ``module`` imports here, and if not why, in words naming ``what``.

    A missing package raises ``ImportError`` (``missing`` says what to install), native libraries that do
    not load raise ``OSError``, and a broken install may raise anything while importing. ``on_import``
    runs once after a successful import.
    """

    def __init__(
        self, module: str, what: str, missing: str, on_import: Callable[[], None] | None = None
    ) -> None:
        self.module, self._what, self._missing, self._on_import = module, what, missing, on_import
        self._lock = threading.Lock()
        self._result: Availability | None = None

    def __call__(self, *, isolated: bool = False, timeout_s: float = 60.0) -> Availability:
        """The cached answer, found now if there is none. With ``isolated=True`` the import is first
        tried in a child interpreter, so that a native crash there cannot take this process down."""
        with self._lock:
            if self._result is None:
                self._result = (isolated and self._in_child(timeout_s)) or self._here()
            return self._result

    def forget(self) -> None:
        """Drop the cached answer: the next probe imports again."""
        with self._lock:
            self._result = None

    def _in_child(self, timeout_s: float) -> Availability | None:
        """Why the import fails in a child interpreter, or None when it succeeds there."""
        try:
            child = subprocess.run(
                [sys.executable, "-c", f"import {self.module}"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Availability(False, f"probing {self._what} in a child failed: {exc}")
        if child.returncode != 0:
            last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
            return Availability(False, f"{self._what} does not import: {last}")
        return None

    def _here(self) -> Availability:
        try:
            importlib.import_module(self.module)
        except ImportError as exc:
            return Availability(False, self._missing.format(exc=exc))
        except OSError as exc:
            return Availability(False, f"{self._what}'s native libraries failed to load: {exc}")
        except Exception as exc:  # a broken install can raise anything while importing
            return Availability(
                False, f"{self._what} failed while importing: {type(exc).__name__}: {exc}"
            )
        if self._on_import is not None:
            self._on_import()
        return Availability(True, f"{self._what} imported")
