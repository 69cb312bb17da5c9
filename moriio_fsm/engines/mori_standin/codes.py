"""The enums mori 1.2.4 binds, with its values (``mori/io/enum.hpp``, ``peer_failure.hpp``).

Rules: ``EXPORTED`` holds the members that pybind11's ``export_values()`` puts at module level (BackendType,
MemoryLocationType and StatusCode; later names win, as there); PollCqMode and PeerFailureReason are not exported.
"""

from __future__ import annotations

from typing import Any

from .enums import make_enum

__all__ = [
    "EXPORTED",
    "BackendType",
    "MemoryLocationType",
    "PeerFailureReason",
    "PollCqMode",
    "StatusCode",
    "FIRST_ERROR",
]

EXPORTED: dict[str, Any] = {}

BackendType = make_enum(
    "BackendType", {"Unknown": 0, "XGMI": 1, "RDMA": 2, "TCP": 3, "FABRIC": 4}, EXPORTED
)
MemoryLocationType = make_enum("MemoryLocationType", {"Unknown": 0, "CPU": 1, "GPU": 2}, EXPORTED)
StatusCode = make_enum(
    "StatusCode",
    {
        "SUCCESS": 0,
        "INIT": 1,
        "IN_PROGRESS": 2,
        "ERR_INVALID_ARGS": 11,
        "ERR_NOT_FOUND": 12,
        "ERR_RDMA_OP": 13,
        "ERR_BAD_STATE": 14,
        "ERR_GPU_OP": 15,
    },
    EXPORTED,
)
PollCqMode = make_enum("PollCqMode", {"POLLING": 0, "EVENT": 1})
PeerFailureReason = make_enum(
    "PeerFailureReason",
    {
        "UNKNOWN": 0,
        "PEER_UNREACHABLE": 1,
        "LOCAL_QP_ERROR": 2,
        "LOCAL_PORT_DOWN": 3,
        "LOCAL_DEVICE_FATAL": 4,
        "LOCAL_CQ_ERROR": 5,
    },
)

#: mori's ERR_BEGIN: a code above it is a failure, and sticks.
FIRST_ERROR = 10
