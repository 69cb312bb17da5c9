"""The NIXL transfer engine (UCX: TCP, shared memory, RDMA where present), for hosts without AMD hardware.

Rules: importing this package never imports ``nixl``; it is imported when an engine starts or ``probe_nixl`` runs,
and a missing or broken install is reported as a reason, as ``probe_mori`` does.
"""

from .availability import NixlAvailability, NixlUnavailableError, probe_nixl
from .descriptors import NixlEngineDesc, NixlMemoryDesc
from .engine import NixlEngine
from .session import NixlSession
from .ucx_env import check_ucx_overrides, ucx_environment

__all__ = [
    "NixlAvailability",
    "NixlEngine",
    "NixlEngineDesc",
    "NixlMemoryDesc",
    "NixlSession",
    "NixlUnavailableError",
    "check_ucx_overrides",
    "probe_nixl",
    "ucx_environment",
]
