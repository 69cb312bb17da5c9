"""Starting a NIXL agent with its UCX backend, and what NIXL could not free.

Rules: an agent runs without NIXL's progress and listen threads (the engine's thread progresses
it); a backend that does not start is a ``NixlUnavailableError`` naming the UCX settings in force.
"""

from __future__ import annotations

import os
from typing import Any

from .availability import NixlUnavailableError

__all__ = ["lingering", "start_agent"]

# What a transfer that NIXL or UCX could not stop still holds (its handle, its agent, its
# tensors): kept for the life of the process so that bytes still moving land in memory
# nobody reuses. A leak, never a corruption.
lingering: list[Any] = []


def start_agent(api: Any, key: str) -> Any:
    """A NIXL agent named ``key`` with the UCX backend created (``api``: the imported nixl module)."""
    config = api.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[]
    )
    agent = api.nixl_agent(key, config)
    if "UCX" not in agent.get_plugin_list():
        raise NixlUnavailableError(
            f"nixl has no UCX plugin here (plugins: {agent.get_plugin_list()})"
        )
    try:
        agent.create_backend("UCX", {})
    except Exception as exc:
        settings = ", ".join(
            f"{name}={os.environ[name]}" for name in sorted(os.environ) if name.startswith("UCX_")
        )
        raise NixlUnavailableError(
            f"NIXL's UCX backend did not start for engine {key!r} ({settings}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return agent
