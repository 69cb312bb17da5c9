"""``--backend`` of the demo and serve-pd, and serve-pd's one-side roles, without vLLM: the
options parse, a bad value or a backend that cannot run is refused naming why, and the
servers are started with the backend, address, ports and trusted peers asked for (a
stand-in server process records what it was given)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_vllm_process import fake_python

from moriio_fsm.cli import main
from moriio_fsm.serving import demo
from moriio_fsm.serving.backends import BACKENDS, BackendUnavailable, require_backend
from moriio_fsm.serving.demo_options import DemoOptions
from moriio_fsm.serving.instances import Instance
from moriio_fsm.serving.launcher import PORT_RANGE, PdDeployment

ROOT = Path(__file__).resolve().parents[2]


def three_free_ports() -> int:
    """A first port whose next two are free on 127.0.0.1 too."""
    for base in range(PORT_RANGE[0] + (os.getpid() * 7) % 5000, PORT_RANGE[1] - 3, 3):
        try:
            held = []
            for port in range(base, base + 3):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise OSError("no three free ports in a row")


def mori_imports_here() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import mori.io"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """vLLM's python replaced by the stand-in; its records' folder."""
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv("MORIIO_FSM_VLLM_PYTHON", str(fake_python(tmp_path)))
    monkeypatch.setenv("FAKE_VLLM_RECORDS", str(records))
    return records


def recorded(records: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(records.glob("*.json"))]


# -- parsing and refusals ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["demo", "serve-pd"])
def test_a_backend_outside_the_three_is_refused_by_the_parser_naming_the_choices(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--backend", "infiniband"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--backend" in err and all(name in err for name in BACKENDS)


@pytest.mark.parametrize("value", ["ucx", "", None, 3])
def test_the_demo_options_and_a_deployment_refuse_an_unknown_backend(tmp_path, value):
    with pytest.raises(ValueError, match="--backend: expected one of same_host, nixl, rdma"):
        DemoOptions(backend=value)
    with pytest.raises(ValueError, match="--backend"):
        PdDeployment("m", "write", tmp_path, backend=value)


@pytest.mark.parametrize("command", ["demo", "serve-pd"])
def test_each_command_takes_each_backend_and_defaults_to_same_host(command):
    from moriio_fsm.cli import build_parser

    assert build_parser().parse_args([command]).backend == "same_host"
    for name in BACKENDS:
        assert build_parser().parse_args([command, "--backend", name]).backend == name


def test_rdma_that_cannot_load_is_refused_before_any_server_starts_saying_why(
    tmp_path, stand_in, capsys
):
    if mori_imports_here():
        pytest.skip("mori.io imports in this python: rdma's refusal cannot be shown here")
    code = main(
        ["demo", "--backend", "rdma", "--workdir", str(tmp_path / "demo"), "--requests", "1"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "--backend rdma cannot run" in err and "mori.io" in err and "--backend nixl" in err
    assert recorded(stand_in) == []  # no server was started
    code = main(["serve-pd", "--backend", "rdma", "--model", "m", "--workdir", str(tmp_path)])
    assert code == 2 and "--backend rdma cannot run" in capsys.readouterr().err
    assert recorded(stand_in) == []


def test_a_backend_whose_package_is_missing_names_the_import_that_failed(tmp_path):
    python = tmp_path / "python-without-nixl"
    python.write_text(
        "#!/bin/sh\n"
        f'exec {sys.executable} -c \'import sys; sys.modules["nixl"] = None; '
        'exec(sys.argv[2])\' "$@"\n'
    )
    python.chmod(0o755)
    with pytest.raises(BackendUnavailable) as refused:
        require_backend("nixl", str(python))
    assert "--backend nixl cannot run" in str(refused.value)
    assert "nixl" in str(refused.value) and "pip install nixl" in str(refused.value)
    require_backend("same_host", str(python))  # needs nothing: never asks


def test_the_fault_demo_over_a_backend_without_engine_faults_is_refused():
    with pytest.raises(ValueError, match="--faults .* same_host engine.*--backend nixl"):
        DemoOptions(faults=0.05, backend="nixl")
    DemoOptions(faults=0.05, backend="same_host")


# -- the servers get the backend -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_server_of_a_deployment_gets_its_backend(tmp_path, stand_in, backend):
    deployment = PdDeployment("m", "read", tmp_path, backend=backend, prefills=2)
    with deployment:
        deployment.start(timeout_s=60, show_progress=False)
        got = recorded(stand_in)
    assert len(got) == 3
    assert {r["kv_transfer_config"]["kv_connector_extra_config"]["backend"] for r in got} == {
        backend
    }


def test_the_demo_hands_its_backend_to_its_servers(tmp_path, stand_in, monkeypatch):
    seen = []

    def serve(deployment, *args):
        deployment.start(timeout_s=60, show_progress=False)
        try:
            seen.extend(recorded(stand_in))
        finally:
            deployment.stop()
        raise KeyboardInterrupt  # the run ends here

    monkeypatch.setattr(demo, "_serve", serve)
    options = DemoOptions(backend="nixl", requests=1, workdir=tmp_path, show_progress=False)
    with pytest.raises(KeyboardInterrupt):
        demo.run(options, log=lambda text: None, model="m", expected=[[1]])
    assert [r["kv_transfer_config"]["kv_connector_extra_config"]["backend"] for r in seen] == [
        "nixl",
        "nixl",
    ]


# -- one side per host ---------------------------------------------------------------------


def test_a_one_side_host_off_loopback_must_name_its_peers(tmp_path, capsys):
    code = main(
        ["serve-pd", "--role", "decode", "--host", "198.18.0.2", "--workdir", str(tmp_path)]
    )
    assert code == 2 and "--trust must name the peer hosts" in capsys.readouterr().err
    code = main(["serve-pd", "--trust", "198.18.0.1", "--workdir", str(tmp_path)])
    assert code == 2 and "--trust applies to --role prefill or decode" in capsys.readouterr().err


def test_a_prefill_host_starts_only_p_on_its_address_ports_and_peers_and_stops_when_p_exits(
    tmp_path, stand_in
):
    first = three_free_ports()
    command = [
        sys.executable,
        "-m",
        "moriio_fsm.cli",
        "serve-pd",
        "--role",
        "prefill",
        "--backend",
        "nixl",
        "--mode",
        "write",
        "--host",
        "127.0.0.1",
        "--port",
        str(first),
        "--trust",
        "127.0.0.2,198.18.0.0/24",
        "--model",
        "m",
        "--workdir",
        str(tmp_path / "work"),
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if any(line.strip().startswith("--prefill ") for line in lines):
                break  # ready: what the proxy needs is printed
            time.sleep(0.2)
        (server,) = recorded(stand_in)
        config = server["kv_transfer_config"]
        extra = config["kv_connector_extra_config"]
        assert config["kv_role"] == "kv_producer"
        assert (extra["backend"], extra["host_ip"], extra["read_mode"]) == (
            "nixl",
            "127.0.0.1",
            False,
        )
        assert (extra["notify_port"], extra["handshake_port"]) == (first + 1, first + 2)
        assert extra["trusted_peers"] == ["127.0.0.2", "198.18.0.0/24"]
        assert server["argv"][server["argv"].index("--port") + 1] == str(first)
        assert server["VLLM_HOST_IP"] == "127.0.0.1"
        pid = int(Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)  # P crashes: the host's serve-pd stops and says so
        process.wait(60)
        reader.join(10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    output = "".join(lines)
    assert process.returncode == 1, output
    assert f"P0 (pid {pid}) exited" in output
    (line,) = [x.strip() for x in output.splitlines() if x.strip().startswith("--prefill ")]
    spec = line.removeprefix("--prefill ")
    instance = Instance.parse("P0", spec)  # what moriio-fsm proxy is given takes it
    assert (instance.url, instance.kv_host) == (f"http://127.0.0.1:{first}", "127.0.0.1")
    assert (instance.notify_port, instance.handshake_port) == (first + 1, first + 2)
