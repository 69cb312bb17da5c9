"""The package passes its linter, its formatter's check and its type checker.

Rules: the tools and their settings are the ones pyproject.toml names (the dev extra pins
them); a finding fails the suite with the tool's own report, so the fix is in the message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECKS = {
    "ruff lint": ["-m", "ruff", "check", "--no-cache", "."],
    "ruff format": ["-m", "ruff", "format", "--check", "--no-cache", "."],
    "mypy": ["-m", "mypy"],
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_tree_is_clean_for(name: str) -> None:
    done = subprocess.run(
        [sys.executable, *CHECKS[name]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"{name} found problems:\n{done.stdout}\n{done.stderr}"
