"""The launcher's guarantees that need no vLLM: servers die with their launcher, ports are
distinct and outside the ephemeral range, bad deployments are refused up front."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moriio_fsm.serving.launcher import PORT_RANGE, PdDeployment, free_ports

ROOT = Path(__file__).resolve().parents[2]


def test_a_child_dies_when_its_launcher_is_killed_outright():
    code = (
        "import subprocess, sys, time; from moriio_fsm.serving import vllm_server as v; "
        "c = subprocess.Popen(['sleep', '60'], preexec_fn=v._die_with_parent, "
        "start_new_session=True); print(c.pid, flush=True); time.sleep(60)"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    child = int(launcher.stdout.readline())
    try:
        launcher.kill()  # SIGKILL: no finally block of the launcher runs
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                break
            if state == "Z":  # dead, waiting to be reaped by init
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"child {child} outlived its launcher")
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass


def test_ports_are_distinct_and_below_the_ephemeral_range():
    ports = free_ports(60)
    assert len(set(ports)) == 60
    assert all(PORT_RANGE[0] <= p < PORT_RANGE[1] for p in ports)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"mode": "push"}, "mode"),
        ({"failure_policy": "retry"}, "failure_policy"),
        ({"prefills": 0}, "prefills"),
        ({"decodes": 9}, "decodes"),
        ({"prefills": True}, "prefills"),
    ],
)
def test_bad_deployments_are_refused_naming_the_setting(tmp_path, kwargs, expected):
    settings = {"model": "m", "mode": "write", "workdir": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=expected):
        PdDeployment(**settings)
