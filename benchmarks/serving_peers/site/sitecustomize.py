"""Run-time workarounds for the vLLM servers of the serving race, loaded through PYTHONPATH.

Each workaround is switched on by name in ``$BENCH_WORKAROUNDS`` (comma-separated) and is
applied in every Python process of a server (the API server, EngineCore, the spawned
worker), either at once or right after the module it fixes is imported. No installed file
is changed. Every process that applied one appends ``<pid> <peer> <name>: <what>`` to
``$BENCH_WORKAROUND_LOG``, so the bench can say which were needed.
"""

import importlib.abc
import importlib.util
import os
import sys

_WANTED = {
    name.strip() for name in os.environ.get("BENCH_WORKAROUNDS", "").split(",") if name.strip()
}
_LOG = os.environ.get("BENCH_WORKAROUND_LOG")


def _note(name, what):
    if _LOG:
        try:
            with open(_LOG, "a") as handle:
                handle.write(f"{os.getpid()} {os.environ.get('BENCH_PEER', '?')} {name}: {what}\n")
        except OSError:
            pass


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls a patch function on a module right after its code ran (its first import)."""

    def __init__(self):
        self.patches = {}

    def find_spec(self, fullname, path, target=None):
        patches = self.patches.pop(fullname, None)
        if patches is None:
            return None
        # Find the real spec with the other finders, then wrap its loader's exec_module.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                real_exec = spec.loader.exec_module

                def exec_module(module, _real=real_exec, _patches=patches):
                    _real(module)
                    for patch in _patches:
                        patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


_hooks = _AfterImport()


def _after_import(module_name, patch):
    if module_name in sys.modules:
        patch(sys.modules[module_name])
    else:
        _hooks.patches.setdefault(module_name, []).append(patch)


# -- AMX: vLLM's CPU attention kernel runs AMX tile instructions without asking Linux for
# the AMX state; a process whose first forward is a single token dies with SIGILL. Ask for
# it once per process (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
if "amx" in _WANTED:
    try:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
        if _libc.syscall(158, 0x1023, 18) == 0:
            _note("amx", "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) granted")
        else:
            _note(
                "amx",
                f"not needed here: arch_prctl(ARCH_REQ_XCOMP_PERM) refused ({os.strerror(ctypes.get_errno())}): "
                "this CPU has no AMX",
            )
    except OSError:
        pass


# -- NIXL: its worker pins the compute thread to the last core of the NUMA node (D's core
# here), so P would compute on D's core: report no NUMA topology instead.
if "nixl_no_numa_pin" in _WANTED:

    def _no_numa(module):
        platform = getattr(module, "CpuPlatform", None)
        if platform is not None:
            platform.discover_numa_topology = classmethod(lambda cls: [])
            _note("nixl_no_numa_pin", "CpuPlatform.discover_numa_topology() -> []")

    _after_import("vllm.platforms.cpu", _no_numa)


# -- NIXL: the Python agent starts a progress thread that spins a whole core (of two);
# vLLM polls its transfers every step anyway, so create agents without it.
if "nixl_no_progress_thread" in _WANTED:

    def _no_progress_thread(module):
        config = getattr(module, "nixl_agent_config", None)
        if config is None or getattr(config, "_bench_patched", False):
            return
        real_init = config.__init__

        def __init__(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            self.enable_pthread = False

        config.__init__ = __init__
        config._bench_patched = True
        _note(
            "nixl_no_progress_thread",
            f"{module.__name__}.nixl_agent_config(enable_prog_thread=False)",
        )

    for _name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        _after_import(_name, _no_progress_thread)


_MOONCAKE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

# -- Mooncake: its worker asks torch.accelerator for the current device, which raises on a
# CPU-only torch; during its constructor the answer is device 0.
if "mooncake_device_index" in _WANTED:

    def _device_zero(module):
        worker = getattr(module, "MooncakeConnectorWorker", None)
        if worker is None:
            return
        real_init = worker.__init__

        def __init__(self, *args, **kwargs):
            import torch

            real_index = torch.accelerator.current_device_index
            torch.accelerator.current_device_index = lambda: 0
            try:
                real_init(self, *args, **kwargs)
            finally:
                torch.accelerator.current_device_index = real_index

        worker.__init__ = __init__
        _note(
            "mooncake_device_index",
            "torch.accelerator.current_device_index() -> 0 in MooncakeConnectorWorker()",
        )

    _after_import(_MOONCAKE, _device_zero)

# -- Mooncake: its bootstrap server listens on 0.0.0.0; make it listen on loopback only.
if "mooncake_bootstrap_loopback" in _WANTED:

    def _loopback(module):
        server = getattr(module, "MooncakeBootstrapServer", None)
        if server is None:
            return
        real_init = server.__init__

        def __init__(self, host, port, *args, **kwargs):
            real_init(self, "127.0.0.1", port, *args, **kwargs)

        server.__init__ = __init__
        _note("mooncake_bootstrap_loopback", "MooncakeBootstrapServer binds 127.0.0.1, not 0.0.0.0")

    _after_import("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils", _loopback)


# -- Measurement, not a fix: Mooncake exposes no Prometheus metrics, so time each of its
# synchronous batch writes (what its own stats time) into $BENCH_MOONCAKE_TIMES (JSONL).
if "mooncake_time_writes" in _WANTED and os.environ.get("BENCH_MOONCAKE_TIMES"):

    def _time_writes(module):
        worker = getattr(module, "MooncakeConnectorWorker", None)
        if worker is None:
            return
        real_send = worker._send_blocks

        def _send_blocks(self, remote_session, src_ptrs, dst_ptrs, lengths):
            import json
            import time

            start = time.monotonic()
            result = real_send(self, remote_session, src_ptrs, dst_ptrs, lengths)
            end = time.monotonic()
            with open(os.environ["BENCH_MOONCAKE_TIMES"], "a") as handle:
                handle.write(
                    json.dumps(
                        {
                            "start": start,
                            "end": end,
                            "bytes": int(sum(lengths)),
                            "descs": len(src_ptrs),
                            "ret": result,
                        }
                    )
                    + "\n"
                )
            return result

        worker._send_blocks = _send_blocks
        _note(
            "mooncake_time_writes", "times MooncakeConnectorWorker._send_blocks (measurement only)"
        )

    _after_import(_MOONCAKE, _time_writes)


# -- mori: vLLM's MoRIIOConnector imports mori.io, which needs AMD's native module; load the
# project's stand-in under the pinned wheel's own Python layer instead, at the first
# `import mori` of each process (API server, EngineCore, spawned workers), never before.
if "mori_standin" in _WANTED:

    def _standin_logs_to_server_log():
        """The stand-in's lines (its start line first) go where vLLM's go, or to stderr."""
        import logging

        from moriio_fsm.logs import share_handlers_of

        share_handlers_of("vllm")
        package = logging.getLogger("moriio_fsm")
        if all(isinstance(h, logging.NullHandler) for h in package.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            package.addHandler(handler)

    class _MoriStandInLoader(importlib.abc.Loader):
        def __init__(self, finder):
            self.finder = finder

        def create_module(self, spec):
            self.finder.loading = True
            try:
                from moriio_fsm.engines.mori_standin import load_mori_io

                _standin_logs_to_server_log()
                load_mori_io()
            except Exception as exc:  # an ImportError, which vLLM's guard expects, naming why
                _note("mori_standin", f"NOT loaded: {type(exc).__name__}: {exc}")
                raise ImportError(f"the mori stand-in did not load: {exc}") from exc
            finally:
                self.finder.loading = False
            module = sys.modules["mori"]
            spec.submodule_search_locations = list(module.__path__)
            _note(
                "mori_standin",
                "mori.cpp is moriio_fsm's stand-in under amd-mori's own Python layer "
                "(load_mori_io() at this process's first `import mori`)",
            )
            return module

        def exec_module(self, module):
            pass  # load_mori_io() ran the wheel's mori/__init__.py already

    class _MoriStandInFinder(importlib.abc.MetaPathFinder):
        """Answers the first ``import mori`` with the stand-in (the loader's own look-ups pass)."""

        def __init__(self):
            self.loading = False

        def find_spec(self, fullname, path, target=None):
            if fullname != "mori" or self.loading or "mori" in sys.modules:
                return None
            return importlib.util.spec_from_loader(
                "mori", _MoriStandInLoader(self), is_package=True
            )

    sys.meta_path.insert(0, _MoriStandInFinder())


_MORIIO = "vllm.distributed.kv_transfer.kv_connector.v1.moriio."

# -- MoRIIO: its handshake and notify listeners bind "*" (every interface); make them bind
# the loopback. Both modules build the address with make_zmq_path, imported by name.
if "moriio_loopback" in _WANTED:

    def _bind_loopback(module):
        real = getattr(module, "make_zmq_path", None)
        if real is None:
            return

        def make_zmq_path(scheme, host, port=None):
            return real(scheme, "127.0.0.1" if host == "*" else host, port)

        module.make_zmq_path = make_zmq_path
        _note("moriio_loopback", f"{module.__name__}: listeners bind 127.0.0.1, not '*'")

    for _name in ("moriio_connector", "moriio_engine"):
        _after_import(_MORIIO + _name, _bind_loopback)


# -- MoRIIO: when every layer's KV shares one allocation, the worker registers one region
# from a 4096-byte boundary, which a ROCm allocator gives and torch's CPU allocator (64-byte
# aligned, no padding) does not: it then refuses ("shared KV backing too small for
# page-aligned MR"). Register the whole allocation from its start instead; the offsets of
# the layers in it are computed from that start, as the original computes them from its.
if "moriio_unaligned_kv_region" in _WANTED:

    def _unaligned_region(module):
        worker = getattr(module, "MoRIIOConnectorWorker", None)
        if worker is None:
            return

        def _build_shared_kv_mr(self, kv_caches):
            import torch

            backing = next(iter(kv_caches.values())).view(torch.uint8)
            nbytes = backing.untyped_storage().nbytes()
            region = torch.as_strided(backing, (nbytes,), (1,), 0)
            start = region.data_ptr()
            return region, {name: cache.data_ptr() - start for name, cache in kv_caches.items()}

        worker._build_shared_kv_mr = _build_shared_kv_mr
        _note(
            "moriio_unaligned_kv_region",
            "MoRIIOConnectorWorker._build_shared_kv_mr registers the KV allocation from its "
            "start (torch's CPU allocator does not page-align it)",
        )

    _after_import(_MORIIO + "moriio_connector", _unaligned_region)


# -- Fault runs only: MoRIIO's P tells D its writes landed with one "write_done" message
# (MoRIIOWrapper.send_notify); drop the first $BENCH_MORIIO_DROP_WRITE_DONE of them.
if "moriio_drop_write_done" in _WANTED:

    def _drop_write_done(module):
        wrapper = getattr(module, "MoRIIOWrapper", None)
        if wrapper is None:
            return
        real_send = wrapper.send_notify
        left = [int(os.environ.get("BENCH_MORIIO_DROP_WRITE_DONE", "1"))]

        def send_notify(self, req_ids, remote_ip, remote_port, message_type=None, **kwargs):
            if message_type == "write_done" and left[0] > 0:
                left[0] -= 1
                _note("moriio_drop_write_done", f"dropped write_done {req_ids!r}")
                return None
            return real_send(self, req_ids, remote_ip, remote_port, message_type, **kwargs)

        wrapper.send_notify = send_notify
        _note(
            "moriio_drop_write_done",
            f"MoRIIOWrapper.send_notify drops the first {left[0]} write_done message(s)",
        )

    _after_import(_MORIIO + "moriio_engine", _drop_write_done)


# -- Fault runs only: the mori stand-in holds the completions of the first writes posted in
# this process until $BENCH_STANDIN_WRITE_HOLD_S after the first of them, so P is still
# writing for that long (a slow NIC); whichever connector made the engine.
if "standin_slow_writes" in _WANTED:

    def _slow_writes(package):
        import threading
        import time

        hold_s = float(os.environ.get("BENCH_STANDIN_WRITE_HOLD_S", "3"))

        class _TimedGate(package.Gate):
            """A gate that opens ``hold_s`` after the first completion it holds back."""

            def __init__(self):
                super().__init__()
                self._timer = None
                self._timer_lock = threading.Lock()

            def when_open(self, callback):
                with self._timer_lock:
                    if self._timer is None:
                        self._timer = threading.Timer(hold_s, self._open_now)
                        self._timer.daemon = True
                        self._timer.start()
                        _note("standin_slow_writes", f"first write held at {time.time():.3f}")
                super().when_open(callback)

            def _open_now(self):
                _note("standin_slow_writes", f"held writes land at {time.time():.3f}")
                self.open()

        times = int(os.environ.get("BENCH_STANDIN_WRITE_HOLD_TIMES", "1000"))
        package.FAULTS.inject("hold", op="write", hold=_TimedGate(), times=times)
        _note(
            "standin_slow_writes",
            f"the stand-in holds the completions of the first {times} write posts "
            f"until {hold_s:g}s after the first",
        )

    _after_import("moriio_fsm.engines.mori_standin", _slow_writes)

if _hooks.patches:
    sys.meta_path.insert(0, _hooks)
