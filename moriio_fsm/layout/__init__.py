"""KV-cache geometry and transfer offsets: pure functions over torch tensors, no I/O."""

from moriio_fsm.layout.geometry import KVLayout, KVLayoutError, LayerGeometry, describe_layer
from moriio_fsm.layout.plan import TransferPlan, as_block_ids, merge_ranges, plan_layer, plan_transfer
from moriio_fsm.layout.planner import TransferPlanner, geometry_key
from moriio_fsm.layout.regions import RegistrationRegion, registration_region, registration_regions
from moriio_fsm.layout.spec import LayerKVSpec

__all__ = [
    "KVLayout",
    "KVLayoutError",
    "LayerGeometry",
    "LayerKVSpec",
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
