"""The watch's settings and the connector it wraps, read from ``kv_connector_extra_config``.

Rules: the inner connector is described the way vLLM's MultiConnector describes a child
(``kv_connector``, ``kv_connector_module_path``, ``kv_connector_extra_config``, and any
other ``KVTransferConfig`` field), and inherits every field it does not give from the
outer config (role, engine id, buffer device...). An unknown or ill-typed key stops the
engine at start, naming the key and what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .settings import ConnectorConfigError

#: The watch's own keys beside ``inner``, with their defaults.
WATCH_DEFAULTS: dict[str, Any] = {
    "stuck_after_s": 120.0,
    "stranded_after_s": 300.0,
    "linger_s": 30.0,
    "tick_interval": 0.5,
    "trace_file": None,
    "trace_ring_size": 4096,
    "otel": False,
}
_SECONDS = ("stuck_after_s", "stranded_after_s", "linger_s", "tick_interval")


@dataclass(frozen=True)
class WatchSettings:
    """What the watch does beside the inner connector."""

    stuck_after_s: float = 120.0
    stranded_after_s: float = 300.0
    linger_s: float = 30.0
    tick_interval: float = 0.5
    trace_file: str | None = None
    trace_ring_size: int = 4096
    otel: bool = False  # OpenTelemetry spans of each transfer (the ``otel`` extra)

    def machine_config(self, name: str) -> dict[str, float]:
        """The config overrides of one watch machine."""
        if name == "watch_consumer":
            return {"stuck_after_s": self.stuck_after_s}
        if name == "watch_producer":
            return {"stranded_after_s": self.stranded_after_s, "linger_s": self.linger_s}
        return {}


def _where(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def read_settings(extra: Any) -> WatchSettings:
    """The watch's settings from the outer ``kv_connector_extra_config`` (``inner`` aside)."""
    if not isinstance(extra, dict):
        raise ConnectorConfigError(
            f"WatchConnector: kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
        )
    unknown = sorted(set(extra) - set(WATCH_DEFAULTS) - {"inner"})
    if unknown:
        raise ConnectorConfigError(
            f"WatchConnector: unknown key(s) {', '.join(map(repr, unknown))} in "
            f"kv_connector_extra_config; known: inner, {', '.join(WATCH_DEFAULTS)}"
        )
    values = {key: extra.get(key, default) for key, default in WATCH_DEFAULTS.items()}
    for key in _SECONDS:
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConnectorConfigError(f"{_where(key)}: expected seconds (a number), got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ConnectorConfigError(f"{_where(key)}: expected seconds > 0, got {value!r}")
        values[key] = float(value)
    trace_file = values["trace_file"]
    if trace_file is not None and (not isinstance(trace_file, str) or not trace_file):
        raise ConnectorConfigError(
            f"{_where('trace_file')}: expected a file name template, got {trace_file!r}"
        )
    ring = values["trace_ring_size"]
    if isinstance(ring, bool) or not isinstance(ring, int) or ring < 1:
        raise ConnectorConfigError(
            f"{_where('trace_ring_size')}: expected an integer >= 1, got {ring!r}"
        )
    if not isinstance(values["otel"], bool):
        raise ConnectorConfigError(
            f"{_where('otel')}: expected true or false, got {values['otel']!r}"
        )
    return WatchSettings(**values)


def inner_transfer_config(outer: Any) -> Any:
    """The inner connector's ``KVTransferConfig``: the outer one with ``inner``'s fields."""
    extra = outer.kv_connector_extra_config
    inner = extra.get("inner") if isinstance(extra, dict) else None
    if not isinstance(inner, dict):
        raise ConnectorConfigError(
            f"WatchConnector: {_where('inner')} must be a mapping naming the connector to "
            f'watch, e.g. {{"kv_connector": "NixlConnector"}}; got {inner!r}'
        )
    name = inner.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise ConnectorConfigError(
            f"WatchConnector: {_where('inner')}['kv_connector'] must name a connector class, "
            f"got {name!r}"
        )
    if name == "WatchConnector":
        raise ConnectorConfigError("WatchConnector: the inner connector cannot be a WatchConnector")
    fields = {f.name for f in dataclasses.fields(outer)}
    unknown = sorted(set(inner) - fields)
    if unknown:
        raise ConnectorConfigError(
            f"WatchConnector: unknown key(s) {', '.join(map(repr, unknown))} in "
            f"{_where('inner')}; known: {', '.join(sorted(fields))}"
        )
    changes = {
        "kv_connector_module_path": None,
        "kv_connector_extra_config": {},
        **copy.deepcopy(inner),
    }
    try:
        return dataclasses.replace(outer, **changes)
    except Exception as exc:  # vLLM's own validation of the inner config
        raise ConnectorConfigError(f"WatchConnector: {_where('inner')}: {exc}") from exc


def inner_vllm_config(vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` whose transfer config is the inner connector's."""
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = inner_transfer_config(vllm_config.kv_transfer_config)
    return inner


def inner_class(transfer_config: Any) -> Any:
    """The inner connector's class, found the way vLLM finds a connector."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        return KVConnectorFactory.get_connector_class(transfer_config)
    except Exception as exc:
        raise ConnectorConfigError(
            f"WatchConnector: cannot load the inner connector "
            f"{transfer_config.kv_connector!r} (module "
            f"{transfer_config.kv_connector_module_path!r}): {exc}"
        ) from exc
