"""P/D instances of vLLM's real scheduler whose connector is the project's connector watched
by ``WatchConnector``: the harness's ``Instance`` with the kv-transfer config wrapped."""

from __future__ import annotations

from dataclasses import dataclass, field

import harness
from harness import Instance

from moriio_fsm.vllm.watch import WatchConnector


@dataclass
class WatchInstance(Instance):
    """An ``Instance`` whose connector is ``WatchConnector`` around ``MoRIIOFSMConnector``."""

    watch: dict = field(default_factory=dict)

    def __post_init__(self):
        real_config, real_connector = harness.KVTransferConfig, harness.MoRIIOFSMConnector

        def wrapped(**fields):
            inner = {
                "kv_connector": fields.pop("kv_connector"),
                "kv_connector_module_path": fields.pop("kv_connector_module_path"),
                "kv_connector_extra_config": fields.pop("kv_connector_extra_config"),
            }
            return real_config(
                kv_connector="WatchConnector",
                kv_connector_module_path="moriio_fsm.vllm.watch",
                kv_connector_extra_config={"inner": inner, "tick_interval": 0.01, **self.watch},
                **fields,
            )

        harness.KVTransferConfig, harness.MoRIIOFSMConnector = wrapped, WatchConnector
        try:
            super().__post_init__()
        finally:
            harness.KVTransferConfig, harness.MoRIIOFSMConnector = real_config, real_connector

    @property
    def scheduler_connector(self) -> WatchConnector:
        return self.scheduler.connector

    @property
    def watch_counts(self):
        return self.scheduler.connector.scheduler_watch.anomalies.counts
