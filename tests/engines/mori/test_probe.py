"""Whether mori.io can be used is asked once and answered with a reason, never with a crash or an exception.

Rules: each test replaces what ``import mori.io`` does for its own duration only, and later tests probe the real
environment again.
"""

import sys

import pytest

from moriio_fsm.engines import MoriEngine, MoriUnavailableError, mori, probe_mori


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(probe_mori, "_result", None)
    yield
    # Later tests must probe the real environment again, not this test's replacement.
    probe_mori.forget()


def test_a_missing_package_is_reported_not_raised(monkeypatch, fresh_probe):
    monkeypatch.setitem(sys.modules, "mori", None)
    monkeypatch.setitem(sys.modules, "mori.io", None)
    availability = probe_mori()
    assert not availability.available and "not installed" in availability.reason
    with pytest.raises(MoriUnavailableError, match="not installed"):
        MoriEngine("prefill")


def test_a_failed_native_load_is_reported_not_raised(monkeypatch, fresh_probe):
    def broken_import(name):
        raise OSError("libhsa-runtime64.so.1: cannot open shared object file")

    monkeypatch.setattr(mori.importlib, "import_module", broken_import)
    availability = probe_mori()
    assert not availability.available
    assert "native libraries" in availability.reason and "libhsa" in availability.reason


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("HIP runtime version mismatch"),
        AttributeError("module 'torch' has no attribute 'hip'"),
        SystemError("initialization of _mori failed"),
    ],
)
def test_any_exception_while_importing_is_reported_not_raised(monkeypatch, fresh_probe, error):
    def broken_import(name):
        raise error

    monkeypatch.setattr(mori.importlib, "import_module", broken_import)
    availability = probe_mori()
    assert not availability.available
    assert type(error).__name__ in availability.reason and str(error) in availability.reason
    with pytest.raises(MoriUnavailableError, match=type(error).__name__):
        MoriEngine("prefill")
