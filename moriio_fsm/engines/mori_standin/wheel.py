"""The pinned amd-mori wheel: fetched once with pip into a cache, checked against its known digest, and its
pure-Python ``mori`` package unpacked beside it.

Rules: the wheel is fetched with pip (``pip download``, the cp312 manylinux build, never installed); a wheel whose
sha256 differs from the pinned one is an error, never used; only ``.py`` files are unpacked, never ``mori/cpp``
(the loader of the native libraries) and never a member that would land outside the target; a finished unpack is
published by renaming, so two processes never see half of one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from ...errors import MoriioFsmError

__all__ = [
    "PINNED_VERSION",
    "WHEEL_FILE",
    "WHEEL_SHA256",
    "WheelMismatch",
    "WheelUnavailable",
    "cache_root",
    "fetch_wheel",
    "python_layer",
]

PINNED_VERSION = "1.2.4"
WHEEL_FILE = f"amd_mori-{PINNED_VERSION}-cp312-cp312-manylinux_2_39_x86_64.whl"
WHEEL_SHA256 = "52dd1ee81e3f0485e4ddc90e99b42dba64ceb2500ee08564a7ba2f9d1a5ef98c"
_PIP_TARGET = (
    "--python-version",
    "3.12",
    "--platform",
    "manylinux_2_39_x86_64",
    "--implementation",
    "cp",
)
_PIP_TIMEOUT_S = 300.0


class WheelUnavailable(MoriioFsmError, RuntimeError):
    """pip could not fetch the pinned wheel here (no index, no network); the message has pip's last words."""


class WheelMismatch(MoriioFsmError, RuntimeError):
    """A file under the pinned wheel's name is not the pinned wheel."""


def cache_root() -> Path:
    """Where fetched wheels live: ``$MORIIO_FSM_CACHE`` or ``~/.cache/moriio-fsm``, then ``wheels``."""
    base = os.environ.get("MORIIO_FSM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "moriio-fsm"
    )
    return Path(base) / "wheels"


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as wheel:
        for chunk in iter(lambda: wheel.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def fetch_wheel(cache: Path | None = None) -> Path:
    """The pinned wheel in ``cache`` (``cache_root()`` by default), fetched with pip if it is not there yet."""
    cache = cache or cache_root()
    wheel = cache / WHEEL_FILE
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
            command = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                *_PIP_TARGET,
                "--dest",
                scratch,
                f"amd-mori=={PINNED_VERSION}",
            ]
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise WheelUnavailable(
                    f"pip download amd-mori=={PINNED_VERSION} failed: {exc}"
                ) from None
            fetched = Path(scratch) / WHEEL_FILE
            if done.returncode != 0 or not fetched.exists():
                last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                raise WheelUnavailable(f"pip could not fetch amd-mori=={PINNED_VERSION}: {last}")
            os.replace(fetched, wheel)
    found = _digest(wheel)
    if found != WHEEL_SHA256:
        raise WheelMismatch(
            f"{wheel} has sha256 {found}, not the pinned wheel's {WHEEL_SHA256}; delete it to "
            "fetch it again"
        )
    return wheel


def _python_members(archive: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    members = []
    for info in archive.infolist():
        path = PurePosixPath(info.filename)
        if path.is_absolute() or ".." in path.parts or path.parts[:1] != ("mori",):
            continue
        if path.suffix != ".py" or path.parts[1:2] == ("cpp",) or "_jit-sources" in path.parts:
            continue
        members.append(info)
    return members


def python_layer(cache: Path | None = None) -> Path:
    """A directory holding the pinned wheel's pure-Python ``mori`` package (fetched and unpacked once)."""
    cache = cache or cache_root()
    target = cache / f"amd_mori-{PINNED_VERSION}-python"
    if (target / "mori" / "io" / "engine.py").exists():
        return target
    wheel = fetch_wheel(cache)
    scratch = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
    try:
        with zipfile.ZipFile(wheel) as archive:
            for info in _python_members(archive):
                archive.extract(info, scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (
                target / "mori" / "io" / "engine.py"
            ).exists():  # not another process's finished unpack
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
