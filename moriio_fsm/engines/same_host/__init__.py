"""CrossMemoryEngine: transfers between processes on one host, straight into the tensors the other process
allocated (the ``same_host`` backend).

Rules: importing this package loads no native code it cannot do without (the C extensions are optional); an
engine refuses to start, saying why, where the kernel's cross-memory calls are missing.
"""

from .engine import (
    CrossMemoryEngine,
    CrossMemoryEngineDesc,
    CrossMemoryMemoryDesc,
    CrossMemorySession,
)
from .iovec import CrossMemoryError

__all__ = [
    "CrossMemoryEngine",
    "CrossMemoryEngineDesc",
    "CrossMemoryError",
    "CrossMemoryMemoryDesc",
    "CrossMemorySession",
]
