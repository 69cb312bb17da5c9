"""LoopbackEngine: mori.io's stand-in for tests and examples, moving real bytes within one process or into a
peer process's shared memory, with fault injection.

Rules: mori's status semantics; nothing here needs anything but torch and msgpack.
"""

from .descriptors import LoopbackEngineDesc, LoopbackMemoryDesc
from .engine import LoopbackEngine, LoopbackSession

__all__ = ["LoopbackEngine", "LoopbackEngineDesc", "LoopbackMemoryDesc", "LoopbackSession"]
