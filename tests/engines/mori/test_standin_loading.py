"""Loading the stand-in: only the pinned wheel's own Python files, never over a mori that imports for real, and
always saying that ``mori.cpp`` is a stand-in.

Rules: what depends on a fresh interpreter (what is imported, what is logged at start) runs in a child process,
bounded in time; the wheel's cache is the one the other tests use, so nothing is fetched twice.
"""

import os
import subprocess
import sys
import zipfile

import pytest

from moriio_fsm.engines import mori_standin
from moriio_fsm.engines.mori_standin import wheel

CHILD_TIMEOUT_S = 120

LOAD_AND_LOG = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s|%(message)s")
from moriio_fsm.engines import mori_standin
{before}
io = mori_standin.load_mori_io()
engine = io.IOEngine("child", io.IOEngineConfig("127.0.0.1", 0))
print(type(engine).__module__, mori_standin.is_loaded(), sys.modules["mori.io"].__file__)
"""


def run_child(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    environment = dict(os.environ, **env)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environment,
        timeout=CHILD_TIMEOUT_S,
    )


def fake_mori(root, io_body: str) -> str:
    """A ``mori`` package under ``root`` whose ``mori/io`` runs ``io_body``; the directory for PYTHONPATH."""
    package = root / "fake" / "mori"
    (package / "io").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "io" / "__init__.py").write_text(io_body)
    return str(root / "fake")


def test_every_start_line_says_it_is_a_stand_in(standin, tmp_path):
    child = run_child(LOAD_AND_LOG.format(before=""), tmp_path)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[:2] == ["mori.io.engine", "True"]
    lines = [
        line
        for line in child.stderr.splitlines()
        if line.startswith("moriio_fsm.engines.mori_standin|")
    ]
    assert lines and all("[mori stand-in]" in line for line in lines)
    assert "mori.cpp is a STAND-IN" in lines[0] and "not AMD's native mori" in lines[0]


def test_a_mori_that_imports_for_real_is_never_shadowed(standin, tmp_path):
    path = fake_mori(tmp_path, "REAL = True\n")
    child = run_child(LOAD_AND_LOG.format(before=""), tmp_path, PYTHONPATH=path)
    assert child.returncode != 0
    assert "StandInRefused" in child.stderr and "imports for real" in child.stderr


def test_a_mori_whose_native_libraries_fail_is_replaced_even_after_a_failed_probe(
    standin, tmp_path
):
    path = fake_mori(tmp_path, "raise OSError('libpci.so.3: cannot open shared object file')\n")
    probe_first = "from moriio_fsm.engines import probe_mori\nassert not probe_mori().available"
    child = run_child(LOAD_AND_LOG.format(before=probe_first), tmp_path, PYTHONPATH=path)
    assert child.returncode == 0, child.stderr
    assert "amd_mori-1.2.4-python" in child.stdout and "fake" not in child.stdout


def test_mori_precompile_is_refused(standin, tmp_path):
    child = run_child(LOAD_AND_LOG.format(before=""), tmp_path, MORI_PRECOMPILE="1")
    assert child.returncode != 0 and "MORI_PRECOMPILE" in child.stderr


def test_only_the_python_files_of_mori_outside_its_native_loader_are_unpacked(tmp_path):
    archive_path = tmp_path / "crafted.whl"
    names = [
        "mori/__init__.py",
        "mori/io/engine.py",
        "mori/cpp/__init__.py",
        "mori/libmori_io.so",
        "../evil.py",
        "/abs/evil.py",
        "mori/../../evil.py",
        "other/x.py",
        "mori/_jit-sources/gen.py",
    ]
    with zipfile.ZipFile(archive_path, "w") as archive:
        for name in names:
            archive.writestr(name, "x = 1\n")
    with zipfile.ZipFile(archive_path) as archive:
        kept = [info.filename for info in wheel._python_members(archive)]
    assert kept == ["mori/__init__.py", "mori/io/engine.py"]


def test_a_cached_file_that_is_not_the_pinned_wheel_is_refused(tmp_path):
    (tmp_path / wheel.WHEEL_FILE).write_bytes(b"PK\x05\x06" + bytes(18))
    with pytest.raises(mori_standin.WheelMismatch, match="sha256"):
        wheel.fetch_wheel(tmp_path)
    with pytest.raises(mori_standin.WheelMismatch):
        wheel.python_layer(tmp_path)
    assert not (tmp_path / f"amd_mori-{wheel.PINNED_VERSION}-python").exists()


def test_when_pip_cannot_fetch_the_wheel_its_words_are_in_the_error(tmp_path, monkeypatch):
    def pip_fails(command, **options):
        assert (
            command[1:4] == ["-m", "pip", "download"]
            and f"amd-mori=={wheel.PINNED_VERSION}" in command
        )
        return subprocess.CompletedProcess(
            command, 1, "", "ERROR: No matching distribution found for amd-mori"
        )

    monkeypatch.setattr(wheel.subprocess, "run", pip_fails)
    with pytest.raises(mori_standin.WheelUnavailable, match="No matching distribution"):
        wheel.fetch_wheel(tmp_path)


USE_THE_SWITCH = """
import sys, torch
from moriio_fsm.engines import MoriEngine, mori_standin
from moriio_fsm.engines.mori import MoriUnavailableError
try:
    engine = MoriEngine("switched", "127.0.0.1", 0)
except MoriUnavailableError as exc:
    print("unavailable:", exc)
    sys.exit(3)
print("loaded", mori_standin.is_loaded())
peer = MoriEngine("switched-peer", "127.0.0.1", 0)
engine.register_remote_engine(engine.unpack_engine_desc(peer.get_engine_desc().pack()))
a, b = torch.ones(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
session = engine.create_session(
    engine.register_torch_tensor(a), engine.unpack_memory_desc(peer.register_torch_tensor(b).pack())
)
for _ in range(3):
    status = session.batch_write([0], [0], [256], session.allocate_transfer_uid())
    status.wait_for(10_000)
    print("write", status.native_code(), int(b.sum()))
    b.zero_()
"""


def test_the_switch_makes_mori_engine_load_the_stand_in_in_a_fresh_process(standin, tmp_path):
    child = run_child(USE_THE_SWITCH, tmp_path, MORIIO_FSM_MORI="standin")
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines()[0] == "loaded True"
    assert child.stdout.splitlines()[1:] == ["write 0 256"] * 3


def test_without_the_switch_mori_engine_says_mori_is_missing(standin, tmp_path):
    child = run_child(USE_THE_SWITCH, tmp_path, MORIIO_FSM_MORI="")
    assert child.returncode == 3 and "mori.io" in child.stdout


def test_a_wrong_switch_value_is_named(standin, tmp_path):
    child = run_child(USE_THE_SWITCH, tmp_path, MORIIO_FSM_MORI="yes")
    assert child.returncode == 3
    assert "MORIIO_FSM_MORI must be 'standin', 'native' or unset, got 'yes'" in child.stdout


def test_faults_from_the_environment_fail_the_posts_they_name(standin, tmp_path):
    faults = '[{"stage": "completion", "op": "write", "skip": 1, "times": 1}]'
    child = run_child(
        USE_THE_SWITCH, tmp_path, MORIIO_FSM_MORI="standin", MORI_STANDIN_FAULTS=faults
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines()[1:] == ["write 0 256", "write 13 0", "write 0 256"]


@pytest.mark.parametrize(
    "faults, named",
    [
        ("not json", "MORI_STANDIN_FAULTS must be a JSON list"),
        ('{"stage": "post"}', "MORI_STANDIN_FAULTS must be a JSON list"),
        ('[{"stage": "hold"}]', "MORI_STANDIN_FAULTS[0]"),
        ('[{"stage": "post"}, {"stage": "post", "landed": -1}]', "MORI_STANDIN_FAULTS[1]: landed"),
        ('[{"stage": "post", "code": 2}]', "MORI_STANDIN_FAULTS[0]: code"),
        ('[{"stage": "post", "rm": 1}]', "MORI_STANDIN_FAULTS[0]"),
    ],
)
def test_bad_faults_in_the_environment_stop_loading_with_the_entry_named(
    standin, tmp_path, faults, named
):
    child = run_child(
        USE_THE_SWITCH, tmp_path, MORIIO_FSM_MORI="standin", MORI_STANDIN_FAULTS=faults
    )
    assert child.returncode == 3 and named in child.stdout, child.stdout + child.stderr


@pytest.mark.parametrize("switch, available", [("standin", "True"), ("", "False")])
def test_availability_says_what_mori_engine_will_do(standin, tmp_path, switch, available):
    code = (
        "from moriio_fsm.engines.mori import mori_availability\n"
        "found = mori_availability()\n"
        "print(found.available, found.reason)\n"
    )
    child = run_child(code, tmp_path, MORIIO_FSM_MORI=switch)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[0] == available
    assert ("stand-in" if switch else "mori.io") in child.stdout
