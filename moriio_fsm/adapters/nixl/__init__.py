"""The NIXL engine's former import path, which the README names: a re-export of ``moriio_fsm.engines.nixl``.

Rules: nothing is defined here; new code imports from ``moriio_fsm.engines.nixl``.
"""

from ...engines.nixl import (
                             NixlAvailability,
                             NixlEngine,
                             NixlEngineDesc,
                             NixlMemoryDesc,
                             NixlSession,
                             NixlUnavailableError,
                             check_ucx_overrides,
                             probe_nixl,
                             ucx_environment,
)

__all__ = ["NixlAvailability", "NixlEngine", "NixlEngineDesc", "NixlMemoryDesc", "NixlSession",
           "NixlUnavailableError", "check_ucx_overrides", "probe_nixl", "ucx_environment"]
