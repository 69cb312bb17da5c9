"""Fixtures for the engine tests: every engine that imports, wired as a P/D pair (MoriEngine through the real
mori.io, or the pinned amd-mori wheel's own Python layer over the stand-in ``mori.cpp`` where that does not import).

Rules: each fixture closes what it opens; a test fails if an engine worker thread outlives it, if a shared
region's memfd is still open or mapped in this process after it (regions are memfds, never /dev/shm files), or
if a cross-memory engine's registration table or pidfd is still open.
"""

import gc
import importlib
import os
import sys
import threading

import pytest
import torch

from moriio_fsm.engines import LoopbackEngine, probe_mori
from moriio_fsm.engines.nixl import probe_nixl
from moriio_fsm.engines.same_host import CrossMemoryEngine
from moriio_fsm.engines.same_host.registry import REGISTRY_NAME_PREFIX
from moriio_fsm.engines.same_host.shared_pages import ADOPTED_NAME_PREFIX
from moriio_fsm.engines.shared_memory import REGION_NAME_PREFIX

# cross_memory_inline: the same-host engine copying on the posting thread (its default on one core);
# cross_memory_shared: the same-host engine sharing registered pages, so that peers copy by memcpy.
ENGINE_KINDS = [
    "loopback",
    "cross_memory",
    "cross_memory_inline",
    "cross_memory_shared",
    "nixl",
    "mori",
]
# The engines that take LoopbackFaults as engine.faults.
FAULT_ENGINE_KINDS = ["loopback", "cross_memory", "cross_memory_inline", "cross_memory_shared"]
ENGINE_THREAD_PREFIXES = ("loopback-", "cross-memory-", "nixl-")

_REGION_MARK = "memfd:" + REGION_NAME_PREFIX
# An adopted region's fd must close with its registration (its mapping is the tensor's memory).
_ENGINE_HANDLE_MARKS = (
    "memfd:" + REGISTRY_NAME_PREFIX,
    "memfd:" + ADOPTED_NAME_PREFIX,
    "anon_inode:[pidfd]",
)


def open_fds(*marks: str) -> set[str]:
    """This process's open fds whose target names one of ``marks``, as "fd N -> target"."""
    handles = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed while listing (the listing's own fd, for one)
        if any(mark in target for mark in marks):
            handles.add(f"fd {name} -> {target}")
    return handles


def engine_handles() -> set[str]:
    """Open fds of cross-memory registration tables, adopted pages and pidfds in this process."""
    return open_fds(*_ENGINE_HANDLE_MARKS)


def region_handles() -> set[str]:
    """Open fds and memory mappings of loopback shared regions in this process."""
    handles = open_fds(_REGION_MARK)
    with open("/proc/self/maps") as maps:
        for line in maps:
            if _REGION_MARK in line:
                fields = line.split(maxsplit=5)
                handles.add(f"mapping {fields[0]} {fields[-1].strip()}")
    return handles


class RegionLeakCheck:
    """Region handles that appeared since this check was made."""

    def __init__(self) -> None:
        self.before = region_handles()

    def leaked(self) -> list[str]:
        new = region_handles() - self.before
        if new:
            gc.collect()  # a region that only a reference cycle keeps mapped is not a leak
            new = region_handles() - self.before
        return sorted(new)


@pytest.fixture
def region_leak_check():
    """The check every test gets, for tests that prove it can fail."""
    return RegionLeakCheck


@pytest.fixture(autouse=True)
def no_leaked_threads_or_regions():
    check = RegionLeakCheck()
    handles_before = engine_handles()
    yield
    leaked_threads = [
        t.name for t in threading.enumerate() if t.name.startswith(ENGINE_THREAD_PREFIXES)
    ]
    assert not leaked_threads, f"engine threads still running after the test: {leaked_threads}"
    leaked = check.leaked()
    assert not leaked, f"the test left shared regions open or mapped: {leaked}"
    new_handles = engine_handles() - handles_before
    if new_handles:
        gc.collect()  # a peer that only a reference cycle keeps is not a leak
        new_handles = engine_handles() - handles_before
    assert not new_handles, f"the test left engine handles open: {sorted(new_handles)}"


def make_engine(kind: str, key: str, **options):
    if kind == "loopback":
        return LoopbackEngine(key, **options)
    if kind == "cross_memory":
        return CrossMemoryEngine(key, inline_copies=False, **options)
    if kind == "cross_memory_inline":
        return CrossMemoryEngine(key, inline_copies=True, **options)
    if kind == "cross_memory_shared":
        return CrossMemoryEngine(key, **({"inline_copies": False, "share_pages": True} | options))
    if kind == "nixl":
        availability = probe_nixl()
        if not availability.available:
            pytest.skip(f"NixlEngine not tested: {availability.reason}")
        from moriio_fsm.engines.nixl import NixlEngine

        return NixlEngine(key, "127.0.0.1", **options)
    mori_io_or_skip()
    from moriio_fsm.engines import MoriEngine

    return MoriEngine(key, "127.0.0.1", 0, **options)


def mori_io_or_skip() -> None:
    """Make ``mori.io`` import: the real one where it does, else the pinned amd-mori wheel's own Python layer over
    the stand-in ``mori.cpp`` (fetched with pip once); skips only when pip cannot fetch that wheel."""
    availability = probe_mori()
    if availability.available:
        return
    from moriio_fsm.engines import mori_standin

    try:
        mori_standin.load_mori_io()
    except mori_standin.WheelUnavailable as exc:
        pytest.skip(f"MoriEngine not tested: {availability.reason}, and {exc}")
    probe_mori.forget()


@pytest.fixture
def mori_io():
    """``mori.io`` (real, or the wheel's over the stand-in; see ``mori_io_or_skip``)."""
    mori_io_or_skip()
    return importlib.import_module("mori.io")


@pytest.fixture(scope="session", autouse=True)
def mori_standin_unloaded_at_the_end():
    """The stand-in the engine tests loaded leaves ``sys.modules`` when the session ends."""
    yield
    if getattr(sys.modules.get("mori.cpp"), "__standin__", False):
        from moriio_fsm.engines import mori_standin

        mori_standin.unload()
        probe_mori.forget()


def page_aligned_zeros(size: int) -> torch.Tensor:
    """A zeroed uint8 tensor that starts on a page boundary (a view into a larger allocation)."""
    page = os.sysconf("SC_PAGE_SIZE")
    whole = torch.zeros(size + page, dtype=torch.uint8)
    skip = -whole.data_ptr() % page
    return whole[skip : skip + size]


class Pair:
    """Two engines that know each other, with a registered tensor each."""

    def __init__(self, kind: str, size: int = 4096, **engine_options):
        self.kind = kind
        self.producer = make_engine(kind, f"{kind}-producer", **engine_options)
        try:
            self.consumer = make_engine(kind, f"{kind}-consumer", **engine_options)
        except BaseException:
            self.producer.close()
            raise
        self.producer.register_remote_engine(
            self.producer.unpack_engine_desc(self.consumer.get_engine_desc().pack())
        )
        self.consumer.register_remote_engine(
            self.consumer.unpack_engine_desc(self.producer.get_engine_desc().pack())
        )
        generator = torch.Generator().manual_seed(size)
        self.source = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        if kind == "loopback":
            self.target = self.consumer.allocate_shared_tensor(size)
        elif kind == "cross_memory_shared":
            self.target = page_aligned_zeros(size)  # whole pages, which the engine shares
        else:
            self.target = torch.zeros(size, dtype=torch.uint8)
        self.source_mem = self.producer.register_torch_tensor(self.source)
        self.target_mem = self.consumer.register_torch_tensor(self.target)
        # The producer only ever sees the consumer's memory as bytes on the wire.
        self.remote_mem = self.producer.unpack_memory_desc(self.target_mem.pack())
        self.session = self.producer.create_session(self.source_mem, self.remote_mem)
        assert self.session is not None

    def close(self):
        if self.kind == "mori":
            from moriio_fsm.engines import mori_standin

            if mori_standin.is_loaded():
                mori_standin.drain()  # no stand-in transfer may touch the tensors once they go
        self.producer.close()
        self.consumer.close()
        # Tensors and sessions map the regions; the leak check runs while pytest
        # still holds this object, so let go of them here.
        del self.session, self.source, self.target


@pytest.fixture(params=ENGINE_KINDS)
def pair(request):
    made = Pair(request.param)
    yield made
    made.close()


@pytest.fixture
def loopback_pair():
    made = Pair("loopback")
    yield made
    made.close()


@pytest.fixture(params=FAULT_ENGINE_KINDS)
def faulty_pair(request):
    """A pair of an engine kind that injects faults from ``engine.faults``."""
    made = Pair(request.param)
    yield made
    made.close()
