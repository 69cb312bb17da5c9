"""The connector's settings, read once from vLLM's ``kv_connector_extra_config``.

Upstream MoRIIO's keys keep their meanings and defaults (so a config written for it
works here); the project's own keys add the engine backend, machine timeouts, traces,
trusted peers and CURVE. Every key is checked at start: an unknown key, or a value of
the wrong type or range, raises ``ConnectorConfigError`` naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..adapters.zmq.messages import RECEIVER
from ..errors import MoriioFsmError
from ..lang.bounds import BrokenBound

#: Engine backends: mori.io's two (real RDMA / XGMI hardware), the same-host engine and NIXL (UCX).
BACKENDS = ("rdma", "xgmi", "same_host", "nixl")

#: When P posts a WRITE transfer's layers: as each layer's KV is saved (overlapping the copy with
#: the next layers' compute, which pays where a NIC copies), or all at once after the forward
#: (where the CPU copies, so overlap only makes the copy and the forward share a core).
WRITE_POSTINGS = ("auto", "layerwise", "after_forward")

#: How the same-host engine copies (``engines/same_host/strategy.py``): by the kernel, into shared
#: pages, or into shared pages with copy assist; ``auto``: shared pages unless ``share_pages`` is
#: off, with copy assist where its native module is built (the default, chosen by measurement:
#: docs/copy-strategies.md).
COPY_STRATEGIES = ("auto", "kernel", "shared_pages", "copy_assist")


class ConnectorConfigError(MoriioFsmError, ValueError):
    """A ``kv_connector_extra_config`` key or a ``kv_role`` the connector cannot use."""


def _int(key: str, value: Any, low: int, high: int) -> int:
    # Upstream reads its numbers with int(...), so decimal strings ("6301") are accepted.
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if type(value) is not int:
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected an integer, "
            f"got {type(value).__name__} {value!r}"
        )
    if not low <= value <= high:
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: {value} is outside [{low}, {high}]"
        )
    return value


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected a number of "
            f"seconds, got {type(value).__name__} {value!r}"
        )
    if not math.isfinite(value) or value <= 0:
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected a positive, "
            f"finite number of seconds, got {value!r}"
        )
    return float(value)


def _flag(key: str, value: Any) -> bool:
    # Upstream's read_mode is the string "true"/"false"; real booleans work too.
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0", ""):
        return value.strip().lower() in ("true", "1")
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise ConnectorConfigError(
        f"kv_connector_extra_config[{key!r}]: expected true or false, "
        f"got {type(value).__name__} {value!r}"
    )


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected a string, "
            f"got {type(value).__name__} {value!r}"
        )
    return value


def _optional_text(key: str, value: Any) -> str | None:
    return None if value is None else _text(key, value)


def _text_list(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected a list of strings, got {value!r}"
        )
    return tuple(value)


def _one_of(choices: tuple[str, ...], what: str) -> Callable[[str, Any], str]:
    """A parser for a name out of ``choices`` (case and surrounding spaces ignored)."""

    def parse(key: str, value: Any) -> str:
        name = _text(key, value).strip().lower()
        if name not in choices:
            raise ConnectorConfigError(
                f"kv_connector_extra_config[{key!r}]: unknown {what} "
                f"{value!r}; expected one of {', '.join(choices)}"
            )
        return name

    return parse


def _machine_overrides(key: str, value: Any) -> dict[str, dict[str, Any]]:
    from ..machines import MACHINE_MODULES, load_machine_spec, resolve_config

    if not isinstance(value, dict):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected a mapping "
            f"of machine name to config, got {type(value).__name__}"
        )
    checked = {}
    for name, overrides in value.items():
        if name not in MACHINE_MODULES:
            raise ConnectorConfigError(
                f"kv_connector_extra_config[{key!r}]: unknown machine "
                f"{name!r}; expected one of {', '.join(MACHINE_MODULES)}"
            )
        try:
            resolve_config(load_machine_spec(name), overrides)
        except ValueError as exc:
            raise ConnectorConfigError(
                f"kv_connector_extra_config[{key!r}][{name!r}]: {exc}"
            ) from None
        checked[name] = dict(overrides)
    return checked


def _curve(key: str, value: Any) -> dict[str, Any] | None:
    """CURVE keys for every control socket: checked here, so a typo stops the start."""
    if value is None:
        return None
    allowed = {"public_key", "secret_key", "authorized_client_keys", "server_keys"}
    if (
        not isinstance(value, dict)
        or not {"public_key", "secret_key"} <= set(value)
        or not set(value) <= allowed
    ):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected a mapping with "
            "public_key and secret_key (Z85 strings), and optionally "
            "authorized_client_keys (a list) and server_keys (host -> key)"
        )
    from ..adapters.zmq import CurveConfig

    options = dict(value)
    options["authorized_client_keys"] = frozenset(
        k.encode() if isinstance(k, str) else k for k in options.get("authorized_client_keys", ())
    )
    options["server_keys"] = {
        h: (k.encode() if isinstance(k, str) else k)
        for h, k in dict(options.get("server_keys", {})).items()
    }
    for name in ("public_key", "secret_key"):
        if isinstance(options[name], str):
            options[name] = options[name].encode()
    try:
        CurveConfig(**options)
    except (ValueError, TypeError) as exc:
        raise ConnectorConfigError(f"kv_connector_extra_config[{key!r}]: {exc}") from None
    return options


def _ucx(key: str, value: Any) -> dict[str, str]:
    """UCX_* environment variables the nixl backend starts its engine with (they win over the environment)."""
    from ..engines.nixl.ucx_env import check_ucx_overrides

    try:
        return check_ucx_overrides(f"kv_connector_extra_config[{key!r}]", value)
    except ValueError as exc:
        raise ConnectorConfigError(str(exc)) from None


#: The control messages a ``message_lose_first`` fault can name.
MESSAGE_KINDS = tuple(RECEIVER)

_FAULT_KEYS = {
    "fail_nth": "int",
    "stall_nth": "int",
    "drop_nth": "int",
    "drop_all": "bool",
    "fail_rate": "rate",
    "latency_s": "seconds",
    "seed": "int",
    # control messages (message_faults.py)
    "message_loss_rate": "rate",
    "message_dup_rate": "rate",
    "message_delay_rate": "rate",
    "message_delay_s": "seconds",
    "message_lose_first": "message kind",
}


def _faults(key: str, value: Any) -> dict[str, Any]:
    """Faults the engine injects into this instance's transfers (testing, chaos runs)."""
    if not isinstance(value, dict):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}]: expected a mapping of {', '.join(_FAULT_KEYS)}"
        )
    checked: dict[str, Any] = {}
    for name, raw in value.items():
        kind = _FAULT_KEYS.get(name)
        where = f"{key}.{name}"
        if kind is None:
            raise ConnectorConfigError(
                f"kv_connector_extra_config[{key!r}]: unknown fault {name!r}; "
                f"expected one of {', '.join(_FAULT_KEYS)}"
            )
        if kind == "int":
            checked[name] = _int(where, raw, 0 if name == "seed" else 1, 1 << 31)
        elif kind == "bool":
            checked[name] = _flag(where, raw)
        elif kind == "message kind":
            if raw not in MESSAGE_KINDS:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config[{where!r}]: expected a message kind "
                    f"({', '.join(MESSAGE_KINDS)}), got {raw!r}"
                )
            checked[name] = raw
        elif kind == "rate":
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 <= raw <= 1:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config[{where!r}]: expected a "
                    f"probability in [0, 1], got {raw!r}"
                )
            checked[name] = float(raw)
        else:
            checked[name] = 0.0 if raw == 0 else _seconds(where, raw)
    return checked


# key -> (parser, default). Upstream's keys first, with upstream's defaults.
_KEYS: dict[str, tuple[Callable[[str, Any], Any], Any]] = {
    "handshake_port": (lambda k, v: _int(k, v, 1, 65535), 6301),
    "notify_port": (lambda k, v: _int(k, v, 1, 65535), 61005),
    "http_port": (lambda k, v: _int(k, v, 1, 65535), None),
    "host_ip": (_optional_text, None),
    "proxy_ip": (_text, ""),
    "proxy_ping_port": (lambda k, v: _int(k, v, 0, 65535), 0),
    "read_mode": (_flag, False),
    "backend": (_one_of(BACKENDS, "backend"), "rdma"),
    "qp_per_transfer": (lambda k, v: _int(k, v, 1, 1024), 1),
    "post_batch_size": (lambda k, v: _int(k, v, -1, 1 << 20), -1),
    "num_workers": (lambda k, v: _int(k, v, 1, 256), 1),
    "transfer_timeout": (_seconds, 30.0),
    "defer_timeout": (_seconds, 60.0),
    "recv_abort_timeout": (_seconds, 120.0),
    # The project's own keys.
    "machine_config": (_machine_overrides, {}),
    "trusted_peers": (_text_list, ()),
    "curve": (_curve, None),
    "trace_file": (_optional_text, None),
    "trace_dump_file": (_optional_text, None),
    "trace_ring_size": (lambda k, v: _int(k, v, 0, 1 << 20), 4096),
    "lease_s": (_seconds, 30.0),
    "tick_interval": (_seconds, 0.02),
    "fault_injection": (_faults, {}),
    "ucx": (_ucx, {}),
    "write_posting": (_one_of(WRITE_POSTINGS, "write posting"), "auto"),
    "share_pages": (_flag, True),
    "copy_strategy": (_one_of(COPY_STRATEGIES, "copy strategy"), "auto"),
    "bind_peers": (_flag, True),
    "otel": (_flag, False),
}


def _check_copy_strategy(values: dict[str, Any]) -> None:
    """A copy strategy other than ``auto`` is the same-host engine's, and one into shared pages needs them."""
    strategy = values["copy_strategy"]
    if strategy == "auto":
        return
    if values["backend"] != "same_host":
        raise ConnectorConfigError(
            f"kv_connector_extra_config['copy_strategy']: copy strategies apply to the "
            f"same_host backend only; backend is {values['backend']!r}"
        )
    if strategy != "kernel" and not values["share_pages"]:
        raise ConnectorConfigError(
            f"kv_connector_extra_config['copy_strategy']: {strategy!r} copies into shared "
            "pages, but share_pages is false; use 'kernel' or share the pages"
        )


@dataclass(frozen=True)
class ConnectorSettings:
    """Every setting the connector uses, checked; see ``_KEYS`` for types and defaults.

    ``machine_config`` overrides one machine's timeouts by name (``{"write_consumer":
    {"safety_timeout_s": 90}}``); upstream's three timeouts map onto the machines in
    ``machine_overrides``. Traces: a flight recorder keeps the last ``trace_ring_size``
    steps (0: no recording unless a file is named); ``trace_file`` writes every step as
    JSONL and ``trace_dump_file`` the steps of transfers that end badly; both may name
    ``{engine_id}``, ``{dp_rank}`` and ``{tp_rank}`` (each rank writes its own file).
    ``ucx`` (backend ``nixl`` only) maps UCX_* variables to strings, set in the worker's
    environment before its engine starts (``UCX_TLS``, ``UCX_NET_DEVICES``, ...).
    ``write_posting`` (WRITE mode, P): ``layerwise`` posts each layer as it is saved,
    ``after_forward`` posts them all when the forward ends; ``auto`` means
    ``after_forward`` for the same-host engine, whose copies run on P's CPU, and
    ``layerwise`` for the others. ``share_pages`` (backend ``same_host``): the KV cache's
    pages go onto a memfd that peers map, so a transfer is a memory copy; any process
    allowed to read this one's /proc/<pid>/fd (ptrace read access, which Yama's
    ptrace_scope 1 does not restrict for the same user) can then map the cache, and a
    mapping outlives a later loss of that permission. ``false`` keeps every copy in the
    kernel, checked each time. ``copy_strategy`` (backend ``same_host``) names how copies into
    and out of this instance's KV cache go: ``kernel``, ``shared_pages`` or ``copy_assist``
    (``COPY_STRATEGIES``). ``bind_peers``: a transfer takes control messages only
    from the host its request named (with ``curve``, only with that host's key); P in READ
    mode, whose request names no D, takes them from the first D that speaks. ``false``
    takes them from any sender (for peers whose messages leave from another address than
    the one the proxy names).
    """

    handshake_port: int = 6301
    notify_port: int = 61005
    http_port: int | None = None
    host_ip: str | None = None
    proxy_ip: str = ""
    proxy_ping_port: int = 0
    read_mode: bool = False
    backend: str = "rdma"
    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_workers: int = 1
    transfer_timeout: float = 30.0
    defer_timeout: float = 60.0
    recv_abort_timeout: float = 120.0
    machine_config: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    trusted_peers: tuple[str, ...] = ()
    curve: Mapping[str, Any] | None = None
    trace_file: str | None = None
    trace_dump_file: str | None = None
    trace_ring_size: int = 4096
    lease_s: float = 30.0
    tick_interval: float = 0.02
    fault_injection: Mapping[str, Any] = field(default_factory=dict)
    ucx: Mapping[str, str] = field(default_factory=dict)
    write_posting: str = "auto"
    share_pages: bool = True
    copy_strategy: str = "auto"
    bind_peers: bool = True
    otel: bool = False  # OpenTelemetry spans of each transfer (the ``otel`` extra)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(_KEYS))}"
            )
        values = {}
        for key, (parse, default) in _KEYS.items():
            raw = extra.get(key)
            # An absent or null key takes the default; so does an empty or zero port,
            # as upstream treats it.
            if raw is None or (key in ("handshake_port", "notify_port") and raw in ("", 0)):
                values[key] = default
            else:
                values[key] = parse(key, raw)
        values["machine_config"] = MappingProxyType(values["machine_config"])
        if values["ucx"] and values["backend"] != "nixl":
            raise ConnectorConfigError(
                f"kv_connector_extra_config['ucx']: UCX settings apply to the nixl "
                f"backend only; backend is {values['backend']!r}"
            )
        values["ucx"] = MappingProxyType(values["ucx"])
        _check_copy_strategy(values)
        settings = cls(**values)
        settings._check_bounds()
        return settings

    def _check_bounds(self) -> None:
        """The configs this mode's two machines get must keep the bounds their specs state
        between them (``exceeds``: D's safety timeout outlasts P's drain, P's lease outlasts
        D's read timeout plus margin); a broken one names the keys that set each value."""
        from ..machines import (
            ConfigBoundError,
            check_config_bounds,
            load_machine_spec,
            resolve_config,
        )

        configs = {
            name: resolve_config(load_machine_spec(name), self.machine_overrides(name))
            for name in MODE_MACHINES[self.mode]
        }
        try:
            check_config_bounds(configs)
        except ConfigBoundError as exc:
            raise ConnectorConfigError(
                "kv_connector_extra_config: "
                + "; ".join(f"{broken}; {self._sources(broken)}" for broken in exc.broken)
            ) from None

    def _sources(self, broken: BrokenBound) -> str:
        """Which keys of ``kv_connector_extra_config`` set the values of a broken bound."""
        keys = [(broken.machine, broken.key)] + [(ref.machine, ref.key) for ref, _ in broken.terms]
        return "in kv_connector_extra_config, " + ", ".join(
            f"{machine}'s {key} is {self._source(machine, key)}" for machine, key in keys
        )

    def _source(self, machine: str, key: str) -> str:
        override = f"machine_config[{machine!r}][{key!r}]"
        if key in self.machine_config.get(machine, {}):
            return override
        if key in _UPSTREAM_KNOBS.get(machine, {}):
            return _UPSTREAM_KNOBS[machine][key][0]
        return f"its spec's default (set by {override})"

    @property
    def posts_after_forward(self) -> bool:
        """WRITE mode: P posts a transfer's layers together once its forward ended."""
        if self.write_posting == "auto":
            return self.backend == "same_host"
        return self.write_posting == "after_forward"

    @property
    def mode(self) -> str:
        return "read" if self.read_mode else "write"

    def machine_overrides(self, name: str) -> dict[str, Any]:
        """The config of machine ``name``: upstream's timeouts mapped on
        (``_UPSTREAM_KNOBS``), then ``machine_config``'s overrides."""
        config = {key: value(self) for key, (_, value) in _UPSTREAM_KNOBS.get(name, {}).items()}
        config.update(self.machine_config.get(name, {}))
        return config


#: The machines each mode runs, P's then D's; the bounds between their configs are checked
#: at start.
MODE_MACHINES = {
    "write": ("write_producer", "write_consumer"),
    "read": ("read_producer", "read_consumer"),
}

#: Upstream's single knobs mapped onto the machines' config: machine -> config key -> (the
#: key of ``kv_connector_extra_config`` it comes from, as messages name it, and its value).
#: D's safety timeout is twice the transfer timeout plus 10 s: more than P's drain, a
#: transfer timeout plus the abandon timeout (10 s by default), as its spec's bound requires.
_UPSTREAM_KNOBS: dict[str, dict[str, tuple[str, Callable[[ConnectorSettings], float]]]] = {
    "write_producer": {
        "defer_timeout_s": ("'defer_timeout'", lambda s: s.defer_timeout),
        "transfer_timeout_s": ("'transfer_timeout'", lambda s: s.transfer_timeout),
    },
    "write_consumer": {
        "write_timeout_s": ("'recv_abort_timeout'", lambda s: s.recv_abort_timeout),
        "safety_timeout_s": (
            "2 * 'transfer_timeout' + 10",
            lambda s: 2 * s.transfer_timeout + 10.0,
        ),
    },
    "read_producer": {"lease_s": ("'lease_s'", lambda s: s.lease_s)},
}
