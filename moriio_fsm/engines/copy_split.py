"""Splitting one large copy across helper threads by bytes, for the engines that copy on the host's CPUs.

Rules: the caller's thread copies the first slice itself; every slice has ended before ``run`` returns or
raises (the caller lets go of the memory right after), and the first error by range order is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["CopyHelpers", "byte_slices"]


def byte_slices(sizes: list[int], total_bytes: int, parts: int) -> list[tuple[int, int]]:
    """[a, b) index ranges of ``sizes`` cut where the running byte count passes each of ``parts`` equal shares."""
    cuts, share, running = [0], total_bytes / parts, 0
    for index, size in enumerate(sizes):
        running += size
        if len(cuts) < parts and running >= share * len(cuts):
            cuts.append(index + 1)
    cuts.append(len(sizes))
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


class CopyHelpers:
    """Up to ``threads`` threads (the caller's among them) copying slices of one batch.

    A copy by the kernel or by memcpy on one thread leaves memory bandwidth unused; handing work
    to another thread costs more than it saves below a few MiB, so ``run`` splits only batches of
    at least ``min_bytes``. The pool is made on the first split and sized for the engine, so that
    a first batch of two ranges caps no later one.
    """

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._name = name
        self._lock = threading.Lock()  # posting threads and the worker may both split first
        self._pool: ThreadPoolExecutor | None = None

    def run(
        self,
        copy_slice: Callable[[int, int], None],
        sizes: list[int],
        total_bytes: int,
        min_bytes: int,
    ) -> None:
        """``copy_slice(a, b)`` copies ranges a to b-1 of the batch; called once per slice."""
        parts = min(self.threads, len(sizes))
        if parts < 2 or total_bytes < min_bytes:
            copy_slice(0, len(sizes))
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix=f"{self._name}-copy"
                )
            pool = self._pool
        slices = byte_slices(sizes, total_bytes, parts)

        def part(a: int, b: int) -> Exception | None:
            # Returned, not raised, so that every slice has ended before the caller hears of it.
            try:
                copy_slice(a, b)
            except Exception as exc:  # noqa: BLE001 - raised below, once all slices ended
                return exc
            return None

        helpers = [pool.submit(part, a, b) for a, b in slices[1:]]
        errors = [part(*slices[0])] + [helper.result() for helper in helpers]
        first = next((error for error in errors if error is not None), None)
        if first is not None:
            raise first

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
