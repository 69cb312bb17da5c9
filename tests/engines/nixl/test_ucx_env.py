"""The UCX environment of a NIXL engine: the user's variables are never overwritten by a default, overrides are
checked and named, NIXL's probe reports a reason instead of raising. Runs without nixl installed.
"""

import logging
import sys

import pytest

from moriio_fsm.engines.nixl import availability, check_ucx_overrides, probe_nixl, ucx_environment
from moriio_fsm.engines.nixl.ucx_env import interface_of


def test_defaults_fill_only_what_is_unset():
    environ = {"UCX_TLS": "tcp"}
    applied = ucx_environment("127.0.0.1", environ=environ)
    assert environ["UCX_TLS"] == "tcp" and "UCX_TLS" not in applied
    assert applied == {"UCX_NET_DEVICES": "lo", "UCX_LOG_FILE": "/dev/stderr", "UCX_MODULES": "^ib"}
    assert ucx_environment("127.0.0.1", environ=environ) == {}


def test_overrides_win_over_the_environment_and_defaults():
    environ = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth9"}
    applied = ucx_environment(
        "127.0.0.1", {"UCX_TLS": "rc,tcp", "UCX_NET_DEVICES": "lo"}, environ=environ
    )
    assert environ["UCX_TLS"] == "rc,tcp" and environ["UCX_NET_DEVICES"] == "lo"
    assert applied["UCX_TLS"] == "rc,tcp"
    # An InfiniBand transport keeps UCX's InfiniBand module loaded.
    assert "UCX_MODULES" not in environ


@pytest.mark.parametrize("tls", ["all", "^cuda", "rc_x,tcp", "ud,self", "dc_mlx5"])
def test_transport_lists_that_may_use_infiniband_keep_its_module(tls):
    environ = {"UCX_TLS": tls}
    ucx_environment("127.0.0.1", environ=environ)
    assert "UCX_MODULES" not in environ


def test_an_address_no_interface_holds_sets_no_device():
    environ = {}
    ucx_environment("192.0.2.77", environ=environ)  # TEST-NET-1: never configured here
    assert "UCX_NET_DEVICES" not in environ
    assert interface_of("not-an-address") is None
    assert interface_of("127.0.0.5") == "lo"


@pytest.mark.parametrize(
    "value, named",
    [
        ({"TLS": "tcp"}, "'TLS'"),
        ({"UCX_": "x"}, "'UCX_'"),
        ({1: "x"}, "1"),
        ({"UCX_TLS": 5}, "'UCX_TLS'"),
        ({"UCX_TLS": None}, "'UCX_TLS'"),
        (["UCX_TLS"], "mapping"),
    ],
)
def test_bad_overrides_are_refused_naming_the_entry(value, named):
    with pytest.raises(ValueError, match=named):
        check_ucx_overrides("ucx", value)


def test_a_missing_nixl_is_a_reason_not_an_exception(monkeypatch):
    monkeypatch.setattr(probe_nixl, "_result", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # importing it now raises ImportError
    monkeypatch.setitem(sys.modules, "nixl", None)
    result = probe_nixl()
    assert not result.available and "nixl is not installed" in result.reason
    with pytest.raises(availability.NixlUnavailableError, match="not installed"):
        availability.nixl_api()
    probe_nixl.forget()  # the next probe imports for real


def test_nixls_log_does_not_go_to_stdout():
    if not probe_nixl().available:
        pytest.skip(probe_nixl().reason)
    for handler in logging.getLogger("nixl").handlers:
        assert getattr(handler, "stream", None) is not sys.stdout
