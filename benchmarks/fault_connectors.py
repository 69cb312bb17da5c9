"""The connectors the fault matrix serves: each side's ``--kv-transfer-config``, its environment
and run-time workarounds, and what a proxy sends each leg.

Rules: every connector is served the way the serving race serves it (``bench_serving.py``), with
the same short timeouts where it has them. vLLM's own connectors run inside the WatchConnector
(``watch`` true), which changes nothing they do and reports what it sees; this project's
connector runs bare, its own machines being what the matrix tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench_serving import MOONCAKE_VENV, WORKAROUNDS, watched
from serving_peers import moriio_upstream as upstream

#: The same short timeouts for every connector that has these keys (upstream's names; ours
#: maps them onto its machines: D's safety timeout is 2 * transfer_timeout + 10).
TIMEOUTS = {"transfer_timeout": 5, "defer_timeout": 8, "recv_abort_timeout": 10}
#: The watch's deadlines in the matrix: a load past this is stuck, KV held for sending past
#: this is stranded (short, so the matrix runs in minutes; the defaults are 120 s and 300 s).
WATCH = {"stuck_after_s": 10.0, "stranded_after_s": 10.0}
PEER_ABORT_S = 480  # NIXL's and Mooncake's default for freeing KV that D never fetched


@dataclass(frozen=True)
class Ports:
    """One server's ports: HTTP, and two the connector listens on (handshake and notify for
    ours and MoRIIO, the side channel for NIXL, the bootstrap server for Mooncake)."""

    http: int
    handshake: int
    notify: int


@dataclass
class Setup:
    """What a fault asks of one side's servers: env, run-time workarounds, our connector's faults."""

    env: dict = field(default_factory=dict)
    workarounds: tuple = ()
    ours_faults: dict = field(default_factory=dict)


class Connector:
    """How one connector is served (each side's config) and asked (its two legs)."""

    name = ""
    timeouts = ""
    workarounds: tuple = ()
    python: str | None = None  # the servers' python; None: the vLLM CPU venv's
    #: Through the mori stand-in, so the stand-in's fault injection reaches it.
    standin = False
    #: D pulls after P answered (READ-like): D's leg carries what P's answer said.
    pull = False
    watch = False
    #: What its logs say about a transfer that went wrong: (pattern, note with {side} and its groups).
    findings: tuple = ()

    def env(self, side: str, ports: Ports) -> dict:
        return {}

    def config(self, role: str, ports: Ports, setup: Setup) -> dict:
        config = self.bare_config(role, ports, setup)
        if not self.watch:
            return config
        config = watched(config)
        config["kv_connector_extra_config"].update(WATCH)
        return config

    def bare_config(self, role: str, ports: Ports, setup: Setup) -> dict:
        raise NotImplementedError

    def legs(self, p: Ports, d: Ports, tid: str) -> tuple[dict, dict, dict]:
        """(P's kv_transfer_params, D's, the headers both legs carry); a pull connector's D
        params are completed from P's answer by ``d_params``."""
        raise NotImplementedError

    def d_params(self, to_d: dict, p_answer: dict) -> dict:
        return to_d


def role_side(role: str) -> str:
    return "P" if role == "kv_producer" else "D"


class Ours(Connector):
    name = "ours-rdma"
    timeouts = (
        f"transfer_timeout {TIMEOUTS['transfer_timeout']}s, defer_timeout {TIMEOUTS['defer_timeout']}s, "
        f"recv_abort_timeout {TIMEOUTS['recv_abort_timeout']}s: D waits that long for P's verdict, "
        f"then {2 * TIMEOUTS['transfer_timeout'] + 10}s (its safety timeout, 2 * transfer_timeout + 10) "
        "for P to confirm its writes stopped"
    )
    standin = True
    findings = (
        (r"vllm\.load_failed .*?reason='(\w+)'", "{side}: load failed ({0})"),
        (r"vllm\.blocks_quarantined .*?reason='(\w+)'", "{side} quarantined its blocks ({0})"),
    )

    def env(self, side, ports):
        return {"MORIIO_FSM_MORI": "standin"}  # its MoriEngine loads the stand-in itself

    def bare_config(self, role, ports, setup):
        extra = {
            "backend": "rdma",
            "host_ip": "127.0.0.1",
            "handshake_port": ports.handshake,
            "notify_port": ports.notify,
            **TIMEOUTS,
        }
        if setup.ours_faults:
            extra["fault_injection"] = setup.ours_faults
        return {
            "kv_connector": "MoRIIOFSMConnector",
            "kv_connector_module_path": "moriio_fsm.vllm.connector",
            "kv_role": role,
            "engine_id": role_side(role),
            "kv_connector_extra_config": extra,
        }

    def legs(self, p, d, tid):
        def to(peer: Ports, flag: str) -> dict:
            return {
                flag: True,
                "transfer_id": tid,
                "remote_host": "127.0.0.1",
                "remote_notify_port": peer.notify,
                "remote_handshake_port": peer.handshake,
            }

        return to(d, "do_remote_decode"), to(p, "do_remote_prefill"), {}


class Upstream(Connector):
    name = "moriio-upstream"
    timeouts = (
        f"transfer_timeout {TIMEOUTS['transfer_timeout']}s, defer_timeout {TIMEOUTS['defer_timeout']}s, "
        f"recv_abort_timeout {TIMEOUTS['recv_abort_timeout']}s (D in WRITE mode has no timeout of its own)"
    )
    workarounds = upstream.MORIIO_WORKAROUNDS
    standin = True
    watch = True
    findings = (
        (
            r"TransferError: .*\n.*RDMA transfer failed: .*?\(code=StatusCode\.(\w+)\)",
            "{side} logged TransferError ({0})",
        ),
        (r"RDMA read TIMED OUT", "{side}: RDMA read timed out"),
    )

    def bare_config(self, role, ports, setup):
        side = upstream.MoriioSide(ports.http, ports.handshake, ports.notify)
        return upstream.server_config(role, side, read_mode=False, timeouts=TIMEOUTS)

    def legs(self, p, d, tid):
        sides = [upstream.MoriioSide(x.http, x.handshake, x.notify) for x in (p, d)]
        headers = {"X-Request-Id": upstream.request_id(*sides)}
        return upstream.prefill_params(tid), upstream.decode_params(tid), headers


class Nixl(Connector):
    name = "nixl"
    timeouts = (
        f"its defaults: P frees KV that D never read after VLLM_NIXL_ABORT_REQUEST_TIMEOUT "
        f"({PEER_ABORT_S}s); UCX over TCP only (UCX_TLS=tcp,self), as between hosts"
    )
    workarounds = WORKAROUNDS["nixl"]
    pull = True
    watch = True
    findings = (
        (r"(NIXL_ERR_\w+)", "{side}: {0}"),
        (r"(Releasing expired KV blocks for request \S+)", "{side}: {0}"),
    )

    def env(self, side, ports):
        # No shared-memory transport: over it D reads a stopped P's memory without P's help,
        # which no two hosts can.
        return {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.handshake),
            "UCX_TLS": "tcp,self",
            "UCX_NET_DEVICES": "lo",
        }

    def bare_config(self, role, ports, setup):
        return {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "engine_id": role_side(role),
        }

    def legs(self, p, d, tid):
        to_p = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return to_p, {}, {}

    def d_params(self, to_d, p_answer):
        return p_answer["kv_transfer_params"]


class Mooncake(Connector):
    name = "mooncake"
    timeouts = (
        f"its defaults: P frees KV that D never took after VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT "
        f"({PEER_ABORT_S}s); mooncake_protocol tcp"
    )
    workarounds = tuple(w for w in WORKAROUNDS["mooncake"] if w != "mooncake_time_writes")
    python = str(MOONCAKE_VENV / "bin" / "python")
    watch = True

    def env(self, side, ports):
        return {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports.handshake)}

    def bare_config(self, role, ports, setup):
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "engine_id": role_side(role),
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }

    def legs(self, p, d, tid):
        to_p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        to_d = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
            "remote_engine_id": "P",
            "remote_bootstrap_addr": f"http://127.0.0.1:{p.handshake}",
        }
        return to_p, to_d, {}


CONNECTORS: dict[str, Connector] = {c.name: c for c in (Ours(), Upstream(), Nixl(), Mooncake())}
