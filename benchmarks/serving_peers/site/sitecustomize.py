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


if _hooks.patches:
    sys.meta_path.insert(0, _hooks)
