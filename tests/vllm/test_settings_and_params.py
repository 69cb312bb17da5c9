"""The connector's two inputs from outside: its extra config (at start) and each request's params.

Upstream MoRIIO's keys keep their meanings and defaults; every unknown or ill-typed value
is refused with the key named. Request params come from clients, so hostile ones must be
refused with a clear error, never reach a socket, never crash the scheduler.
"""

from __future__ import annotations

import math

import pytest
import zmq

from moriio_fsm.vllm.params import TransferParamsError, parse_transfer_params
from moriio_fsm.vllm.settings import ConnectorConfigError, ConnectorSettings


def test_upstream_defaults_and_meanings():
    settings = ConnectorSettings.from_extra_config({})
    assert (settings.handshake_port, settings.notify_port) == (6301, 61005)
    assert settings.mode == "write" and settings.backend == "rdma" and settings.http_port is None
    assert (settings.transfer_timeout, settings.defer_timeout, settings.recv_abort_timeout) == (
        30.0,
        60.0,
        120.0,
    )
    assert (settings.qp_per_transfer, settings.post_batch_size, settings.num_workers) == (1, -1, 1)


def test_upstream_string_forms_are_accepted():
    settings = ConnectorSettings.from_extra_config(
        {
            "read_mode": "True",
            "handshake_port": "7000",
            "notify_port": "",
            "transfer_timeout": "5",
            "http_port": 8000,
            "proxy_ip": "10.0.0.1",
            "proxy_ping_port": "36367",
        }
    )
    assert settings.read_mode and settings.handshake_port == 7000 and settings.notify_port == 61005
    assert settings.transfer_timeout == 5.0 and settings.http_port == 8000


def test_upstream_timeouts_reach_the_machines_and_d_outwaits_p():
    settings = ConnectorSettings.from_extra_config(
        {"transfer_timeout": 4, "defer_timeout": 6, "recv_abort_timeout": 9}
    )
    producer = settings.machine_overrides("write_producer")
    consumer = settings.machine_overrides("write_consumer")
    assert producer == {"defer_timeout_s": 6.0, "transfer_timeout_s": 4.0}
    assert consumer["write_timeout_s"] == 9.0
    # D keeps blocks longer than P's longest drain (transfer timeout + abandon timeout 10 s).
    assert consumer["safety_timeout_s"] > producer["transfer_timeout_s"] + 10.0
    overridden = ConnectorSettings.from_extra_config(
        {"machine_config": {"write_consumer": {"safety_timeout_s": 99}}}
    )
    assert overridden.machine_overrides("write_consumer")["safety_timeout_s"] == 99


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"handshake_prot": 1}, "handshake_prot"),
        ({"notify_port": "port"}, "notify_port"),
        ({"notify_port": 70000}, "notify_port"),
        ({"transfer_timeout": math.nan}, "transfer_timeout"),
        ({"defer_timeout": -1}, "defer_timeout"),
        ({"recv_abort_timeout": math.inf}, "recv_abort_timeout"),
        ({"read_mode": "perhaps"}, "read_mode"),
        ({"backend": "tcp"}, "backend"),
        ({"qp_per_transfer": True}, "qp_per_transfer"),
        ({"trusted_peers": [1, 2]}, "trusted_peers"),
        ({"machine_config": {"write_producer": {"transfer_timeout_s": 0}}}, "machine_config"),
        ({"machine_config": {"nfs_mount": {}}}, "machine_config"),
        ({"curve": {"public_key": "x"}}, "curve"),
        ({"fault_injection": {"fail_rate": 1.5}}, "fault_injection"),
        ({"trace_ring_size": -3}, "trace_ring_size"),
        ({"write_posting": "eventually"}, "write_posting"),
        ({"write_posting": 1}, "write_posting"),
        ({"share_pages": "sometimes"}, "share_pages"),
    ],
)
def test_a_bad_key_stops_the_start_naming_the_key(extra, named):
    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorSettings.from_extra_config(extra)


def test_the_nixl_backend_takes_ucx_variables():
    settings = ConnectorSettings.from_extra_config(
        {"backend": "NIXL", "ucx": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}}
    )
    assert settings.backend == "nixl"
    assert dict(settings.ucx) == {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
    assert dict(ConnectorSettings.from_extra_config({"backend": "nixl"}).ucx) == {}


def test_the_nixl_backend_makes_a_nixl_engine_with_the_ucx_variables(monkeypatch):
    from moriio_fsm.engines import nixl
    from moriio_fsm.vllm.connector import make_engine

    made = []
    monkeypatch.setattr(
        nixl, "NixlEngine", lambda key, host, **options: made.append((key, host, options))
    )
    settings = ConnectorSettings.from_extra_config({"backend": "nixl", "ucx": {"UCX_TLS": "tcp"}})
    make_engine(settings, "127.0.0.1")("P-0")
    assert made == [("P-0", "127.0.0.1", {"ucx": {"UCX_TLS": "tcp"}})]


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"backend": "nixl", "ucx": {"TLS": "tcp"}}, r"ucx.*'TLS'.*UCX_"),
        ({"backend": "nixl", "ucx": {"UCX_TLS": 5}}, r"ucx.*'UCX_TLS'.*string"),
        ({"backend": "nixl", "ucx": {"UCX_TLS": ["tcp"]}}, r"'UCX_TLS'"),
        ({"backend": "nixl", "ucx": "UCX_TLS=tcp"}, r"ucx.*mapping"),
        ({"backend": "same_host", "ucx": {"UCX_TLS": "tcp"}}, r"ucx.*nixl backend only.*same_host"),
        ({"ucx": {"UCX_TLS": "tcp"}}, r"ucx.*nixl backend only.*rdma"),
    ],
)
def test_bad_ucx_settings_are_refused_naming_the_variable(extra, named):
    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorSettings.from_extra_config(extra)


def test_curve_keys_are_checked_at_start():
    public, secret = zmq.curve_keypair()
    settings = ConnectorSettings.from_extra_config(
        {
            "curve": {
                "public_key": public.decode(),
                "secret_key": secret.decode(),
                "authorized_client_keys": [public.decode()],
            }
        }
    )
    assert settings.curve["public_key"] == public
    with pytest.raises(ConnectorConfigError, match="public_key"):
        ConnectorSettings.from_extra_config(
            {"curve": {"public_key": '"' * 40, "secret_key": secret}}
        )


# -- request params ------------------------------------------------------------------------

GOOD = {
    "do_remote_prefill": True,
    "transfer_id": "tx-1",
    "remote_host": "10.0.0.2",
    "remote_notify_port": 61005,
    "remote_handshake_port": 6301,
    "remote_block_ids": [4, 5],
    "remote_engine_id": "P",
    "remote_dp_rank": 1,
    "remote_tp_size": 2,
}


def test_upstream_params_are_read_with_their_meanings():
    params = parse_transfer_params(GOOD)
    assert params.transfer_id == "tx-1" and params.do_remote_prefill and not params.do_remote_decode
    assert params.peer.host == "10.0.0.2" and params.peer.dp_rank == 1 and params.peer.tp_size == 2
    assert params.remote_block_ids == (4, 5)
    # The older "tp_size" key and one list per KV cache group are understood too.
    legacy = parse_transfer_params(
        {**GOOD, "remote_tp_size": None, "tp_size": 4, "remote_block_ids": [[4, 5]]}
    )
    assert legacy.peer.tp_size == 4 and legacy.remote_block_ids == (4, 5)
    assert parse_transfer_params(None) is None
    assert parse_transfer_params({"do_remote_decode": False, "do_remote_prefill": False}) is None


@pytest.mark.parametrize(
    "change, named",
    [
        ({"transfer_id": ""}, "transfer_id"),
        ({"transfer_id": "tx 1\n"}, "transfer_id"),
        ({"transfer_id": 7}, "transfer_id"),
        ({"transfer_id": "t" * 201}, "transfer_id"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_host": ["10.0.0.2"]}, "remote_host"),
        ({"remote_notify_port": 0}, "remote_notify_port"),
        ({"remote_notify_port": None}, "remote_notify_port"),
        ({"remote_handshake_port": 1 << 20}, "remote_handshake_port"),
        ({"remote_dp_rank": -1}, "remote_dp_rank"),
        ({"remote_tp_size": 0.5}, "remote_tp_size"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"remote_block_ids": [1, "2"]}, "remote_block_ids"),
        ({"remote_block_ids": [[1], [2]]}, "remote_block_ids"),
        ({"remote_block_ids": list(range((1 << 20) + 1))}, "remote_block_ids"),
        ({"do_remote_prefill": "true"}, "do_remote_prefill"),
        ({"do_remote_decode": True}, "both"),
        ({"remote_engine_id": 5}, "remote_engine_id"),
    ],
)
def test_hostile_params_are_refused_naming_the_key(change, named):
    with pytest.raises(TransferParamsError, match=named):
        parse_transfer_params({**GOOD, **change})


def test_params_that_are_not_a_mapping_are_refused():
    with pytest.raises(TransferParamsError, match="mapping"):
        parse_transfer_params(["do_remote_prefill"])


def test_a_read_lease_too_short_for_any_read_is_refused_naming_the_keys():
    with pytest.raises(
        ConnectorConfigError, match=r"lease_s.*read_timeout_s \(10.0\) \+ lease_margin_s \(5.0\)"
    ):
        ConnectorSettings.from_extra_config({"read_mode": True, "lease_s": 15})
    ok = ConnectorSettings.from_extra_config(
        {
            "read_mode": True,
            "lease_s": 8,
            "machine_config": {"read_consumer": {"read_timeout_s": 4, "lease_margin_s": 2}},
        }
    )
    assert ok.lease_s == 8
    ConnectorSettings.from_extra_config({"read_mode": False, "lease_s": 1})  # WRITE holds no lease


@pytest.mark.parametrize(
    "backend, posting, after_forward",
    [
        ("same_host", None, True),  # the CPU copies: the copy would share P's core with the forward
        ("rdma", None, False),  # a NIC copies: overlap each layer with the next one's compute
        ("nixl", "auto", False),
        ("same_host", "layerwise", False),
        ("rdma", "after_forward", True),
        ("same_host", " After_Forward ", True),
    ],
)
def test_write_posting_auto_follows_who_copies(backend, posting, after_forward):
    extra = (
        {"backend": backend} if posting is None else {"backend": backend, "write_posting": posting}
    )
    assert ConnectorSettings.from_extra_config(extra).posts_after_forward is after_forward


@pytest.mark.parametrize(
    "extra, shared", [({}, True), ({"share_pages": "false"}, False), ({"share_pages": True}, True)]
)
def test_share_pages_decides_whether_the_same_host_engine_shares_the_kv_cache(extra, shared):
    import torch

    from moriio_fsm.vllm.connector import make_engine

    settings = ConnectorSettings.from_extra_config({"backend": "same_host", **extra})
    engine = make_engine(settings, "127.0.0.1")("settings-share-pages")
    try:
        page = 4096
        whole = torch.zeros(16 * page, dtype=torch.uint8)
        skip = -whole.data_ptr() % page
        desc = engine.register_torch_tensor(whole[skip : skip + 8 * page])
        assert desc.shares_pages is shared
    finally:
        engine.close()


@pytest.mark.parametrize(
    "strategy, shares, offers_board",
    [("kernel", False, False), ("shared_pages", True, False), ("copy_assist", True, True)],
)
def test_copy_strategy_selects_how_peers_copy_into_the_kv_cache(strategy, shares, offers_board):
    """The setting decides what this instance offers its peers: its pages to map, and a board where
    a peer's large writes get this instance's help."""
    import torch

    from moriio_fsm.engines.same_host import copy_assist
    from moriio_fsm.vllm.connector import make_engine

    if offers_board and not copy_assist.available():
        pytest.skip("the native copy-assist module was not built")
    settings = ConnectorSettings.from_extra_config(
        {"backend": "same_host", "copy_strategy": strategy}
    )
    engine = make_engine(settings, "127.0.0.1")(f"settings-{strategy}")
    try:
        page = 4096
        whole = torch.zeros(16 * page, dtype=torch.uint8)
        skip = -whole.data_ptr() % page
        assert engine.register_torch_tensor(whole[skip : skip + 8 * page]).shares_pages is shares
        assert (engine.get_engine_desc().assist_fd >= 0) is offers_board
    finally:
        engine.close()


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            {"backend": "same_host", "copy_strategy": "memcpy"},
            r"copy_strategy.*unknown copy strategy 'memcpy'",
        ),
        ({"copy_strategy": "kernel"}, r"copy_strategy.*same_host backend only.*rdma"),
        (
            {"backend": "nixl", "copy_strategy": "copy_assist"},
            r"copy_strategy.*same_host backend only.*nixl",
        ),
        (
            {"backend": "same_host", "share_pages": False, "copy_strategy": "shared_pages"},
            r"copy_strategy.*'shared_pages'.*share_pages is false",
        ),
        (
            {"backend": "same_host", "share_pages": False, "copy_strategy": "copy_assist"},
            r"copy_strategy.*'copy_assist'.*share_pages is false",
        ),
    ],
)
def test_a_copy_strategy_that_cannot_apply_is_refused_naming_why(extra, named):
    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorSettings.from_extra_config(extra)


def test_auto_and_kernel_stand_without_shared_pages():
    for strategy in ("auto", "kernel"):
        settings = ConnectorSettings.from_extra_config(
            {"backend": "same_host", "share_pages": False, "copy_strategy": strategy}
        )
        assert settings.copy_strategy == strategy
