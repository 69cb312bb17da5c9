"""KV-cache geometry and transfer offsets: which bytes of each layer's cache move where.

Rules: pure functions over torch tensors (shape, strides and dtype only; no I/O); plans
are computed per layer geometry, never reused across geometries; anything that cannot be
planned exactly raises ``KVLayoutError`` naming the layer, the shape and what was expected.
"""

from moriio_fsm.layout.compatibility import KVCacheSummary, KVIncompatibleError, check_compatible
from moriio_fsm.layout.describe import describe_layer
from moriio_fsm.layout.geometry import KVLayout, KVLayoutError, LayerGeometry
from moriio_fsm.layout.head_slice import HeadSlice
from moriio_fsm.layout.kv_format import CPU_ATTN, LayerKVFormat
from moriio_fsm.layout.plan import (
    TransferPlan,
    as_block_ids,
    merge_ranges,
    plan_layer,
    plan_transfer,
)
from moriio_fsm.layout.planner import TransferPlanner, geometry_key
from moriio_fsm.layout.regions import RegistrationRegion, registration_region, registration_regions

__all__ = [
    "CPU_ATTN",
    "KVCacheSummary",
    "KVIncompatibleError",
    "check_compatible",
    "KVLayout",
    "KVLayoutError",
    "HeadSlice",
    "LayerGeometry",
    "LayerKVFormat",
    "RegistrationRegion",
    "TransferPlan",
    "TransferPlanner",
    "as_block_ids",
    "describe_layer",
    "geometry_key",
    "merge_ranges",
    "plan_layer",
    "plan_transfer",
    "registration_region",
    "registration_regions",
]
