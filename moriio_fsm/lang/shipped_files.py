"""The specs that ship inside the package (``moriio_fsm/specs``): their machines' names
and their files.

Rules: names and paths only, nothing loaded here (the loader reads these files to check
bounds, and ``shipped.py`` loads specs with the loader); a missing specs folder is an error
that says to reinstall, not an empty list.
"""

from __future__ import annotations

from pathlib import Path

#: The shipped specs, by name (each has ``specs/<name>.yaml`` and a bindings module of the
#: same name in ``moriio_fsm.machines``).
SHIPPED_SPECS = ("write_producer", "write_consumer", "read_producer", "read_consumer") + (
    "watch_consumer",
    "watch_producer",
    "watch_worker",
)


def specs_dir() -> Path:
    """The folder holding the shipped spec files (package data: ``moriio_fsm/specs``)."""
    folder = Path(__file__).resolve().parent.parent / "specs"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"the shipped specs are missing: {folder} is not a folder; reinstall moriio-fsm"
        )
    return folder


def spec_path(name: str) -> Path:
    return specs_dir() / f"{name}.yaml"
