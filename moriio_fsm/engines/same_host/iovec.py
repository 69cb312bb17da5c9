"""Linux cross-memory attach through ctypes: one batch of byte ranges as process_vm_writev / process_vm_readv calls.

Rules: callers hand over ranges already checked against registered regions; one call carries at most IOV_MAX
iovecs; a call that moved fewer bytes than asked is continued where it stopped; a refusal raises
``CrossMemoryError`` whose message says why and what setting allows it.
"""

from __future__ import annotations

import ctypes
import errno
import operator
import os
import sys
from collections.abc import Callable
from itertools import repeat

from ...errors import MoriioFsmError

__all__ = [
    "IOV_MAX",
    "CrossMemoryError",
    "VectorCall",
    "SYSCALLS",
    "move_ranges",
    "refusal_text",
    "native_calls_problem",
]

# The kernel refuses more than UIO_MAXIOV (1024) iovecs per call with EINVAL.
IOV_MAX = int(os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
if IOV_MAX <= 0:
    IOV_MAX = 1024

# An iovec is two machine words: base address, length.
_WORD = ctypes.sizeof(ctypes.c_void_p)
_IOVEC_BYTES = 2 * _WORD

# (pid, local iovec array address, remote iovec array address, iovec count) -> bytes moved, or -errno.
VectorCall = Callable[[int, int, int, int], int]

_CAP_SYS_PTRACE = 19
_PR_SET_PTRACER_HINT = "allow_same_user_peers=True"


class CrossMemoryError(MoriioFsmError, OSError):
    """Cross-memory attach refused or cut short by the kernel, or a peer that cannot be attached; see ``errno``."""

    errno: int  # always given

    def __init__(
        self, err: int, message: str, *, range_index: int | None = None, bytes_done: int = 0
    ):
        super().__init__(err, message)
        self.range_index = range_index
        self.bytes_done = bytes_done

    def __str__(self) -> str:
        return self.strerror or ""


def _load_native_calls() -> tuple[dict[str, VectorCall], str | None]:
    """The two syscalls as ``VectorCall``s, or why this platform has none."""
    if not sys.platform.startswith("linux"):
        return {}, f"cross-memory attach needs Linux (process_vm_writev); this is {sys.platform}"
    libc = ctypes.CDLL(None, use_errno=True)
    calls = {}
    for op, name in (("write", "process_vm_writev"), ("read", "process_vm_readv")):
        function = getattr(libc, name, None)
        if function is None:
            return {}, f"the C library has no {name} (glibc 2.15 or later provides it)"
        function.restype = ctypes.c_ssize_t
        function.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        calls[op] = _as_vector_call(function)
    return calls, None


def _as_vector_call(function) -> VectorCall:
    # ctypes lets go of the GIL for the call, so other threads run while the kernel copies.
    def call(pid: int, local_iov: int, remote_iov: int, count: int) -> int:
        moved = function(pid, local_iov, count, remote_iov, count, 0)
        return moved if moved >= 0 else -ctypes.get_errno()

    return call


# op ("write" / "read") -> the call an engine makes; looked up for every batch, so a test may
# put a kernel that answers short or refuses in place of the real one (monkeypatch.setitem).
SYSCALLS, _NATIVE_PROBLEM = _load_native_calls()


def native_calls_problem() -> str | None:
    """Why this process cannot use cross-memory attach at all, or None."""
    return _NATIVE_PROBLEM


def _iovec_array(base: int, offsets: list[int], sizes: list[int]):
    """A C array of ``struct iovec`` for ``base + offsets[i]``, ``sizes[i]``, filled by C loops."""
    words = (ctypes.c_size_t * (2 * len(sizes)))()
    words[0::2] = list(map(operator.add, repeat(base), offsets))
    # mypy's ctypes plugin wants a list[c_size_t | int] (a list is invariant); ints are what ctypes takes.
    words[1::2] = sizes  # type: ignore[assignment]
    return words


def move_ranges(
    call: VectorCall,
    pid: int,
    op: str,
    local_base: int,
    remote_base: int,
    local_offsets: list[int],
    remote_offsets: list[int],
    sizes: list[int],
    *,
    range_base: int = 0,
    bytes_base: int = 0,
) -> None:
    """Move every range between this process (``local_base``) and process ``pid`` (``remote_base``).

    ``op`` "write" copies local -> remote, "read" remote -> local. Range ``i`` is one iovec on
    each side, so a short count ends inside one known range; the rest is sent again from
    there. Raises ``CrossMemoryError`` naming the range the kernel stopped at; ``range_base``
    and ``bytes_base`` place these ranges in a larger batch for that message.
    """
    count = len(sizes)
    local_iov = _iovec_array(local_base, local_offsets, sizes)
    remote_iov = _iovec_array(remote_base, remote_offsets, sizes)
    local_at, remote_at = ctypes.addressof(local_iov), ctypes.addressof(remote_iov)
    first, moved_before = 0, 0
    while first < count:
        last = min(first + IOV_MAX, count)
        wanted = sum(local_iov[2 * first + 1 : 2 * last : 2])
        moved = call(
            pid, local_at + first * _IOVEC_BYTES, remote_at + first * _IOVEC_BYTES, last - first
        )
        if moved == wanted:
            first, moved_before = last, moved_before + moved
            continue
        if moved == -errno.EINTR:
            continue
        if moved <= 0:
            err = -moved if moved < 0 else errno.EFAULT  # no progress at all: treat as unreachable
            where = {"range_index": range_base + first, "bytes_done": bytes_base + moved_before}
            raise CrossMemoryError(err, refusal_text(err, pid, op, **where), **where)
        if moved > wanted:
            raise CrossMemoryError(
                errno.EIO,
                f"the kernel reported {moved} bytes moved of {wanted} asked",
                range_index=range_base + first,
                bytes_done=bytes_base + moved_before,
            )
        first = _resume_point(local_iov, remote_iov, first, moved)
        moved_before += moved


def _resume_point(local_iov, remote_iov, first: int, moved: int) -> int:
    """Skip ``moved`` bytes from iovec ``first`` on: shorten the iovec they end in; return its index.

    Only runs after a short count, which is rare, so a Python loop is fine here.
    """
    index = first
    while moved >= local_iov[2 * index + 1]:
        moved -= local_iov[2 * index + 1]
        index += 1
    for iov in (local_iov, remote_iov):
        iov[2 * index] += moved
        iov[2 * index + 1] -= moved
    return index


def refusal_text(
    err: int, pid: int, op: str, *, range_index: int | None = None, bytes_done: int = 0
) -> str:
    """What a cross-memory ``op`` towards process ``pid`` that failed with ``err`` means, and the fix."""
    # Where it stopped matters only past the first byte: a refusal at the start names the whole batch.
    where = (
        f" at range {range_index} (after {bytes_done} bytes)" if range_index or bytes_done else ""
    )
    verb = "write into" if op == "write" else "read from"
    name = errno.errorcode.get(err, str(err))
    if err == errno.EPERM:
        return (
            f"the kernel refused to let process {os.getpid()} {verb} the memory of process {pid}{where} "
            f"(EPERM): cross-memory attach needs ptrace permission over the other process. "
            + _ptrace_advice(pid)
        )
    if err == errno.ESRCH:
        return f"process {pid} is gone (ESRCH){where}: the peer exited or was killed"
    if err == errno.EFAULT:
        return (
            f"an address range{where} is not mapped in process {pid} or in this process (EFAULT): the "
            f"peer unmapped or freed memory it had registered without deregistering it"
        )
    if err == errno.ENOMEM:
        return f"the kernel ran out of memory for the iovecs{where} (ENOMEM)"
    return f"process_vm_{op[0]}v to process {pid} failed{where} ({name}: {os.strerror(err)})"


def _ptrace_advice(pid: int) -> str:
    """What would allow this process to attach to ``pid``, from the facts /proc shows."""
    scope = _read_first_line("/proc/sys/kernel/yama/ptrace_scope")
    own_uid, target_uid = os.getuid(), _uid_of(pid)
    has_cap = _has_cap_sys_ptrace()
    facts = (
        f"This process runs as uid {own_uid} {'with' if has_cap else 'without'} CAP_SYS_PTRACE; "
        f"process {pid} runs as uid {target_uid if target_uid is not None else 'unknown'}; "
        f"kernel.yama.ptrace_scope is {scope if scope is not None else 'absent (no Yama)'}."
    )
    if scope == "2":
        return f"{facts} With ptrace_scope 2 only a process with CAP_SYS_PTRACE may attach: give it to this one."
    if scope == "3":
        return f"{facts} With ptrace_scope 3 no process may attach until the next reboot."
    same_user = (
        "run both processes as the same user (without Yama nothing else is needed)"
        if scope is None
        else "run both processes as the same user with kernel.yama.ptrace_scope = 0 "
        "(sysctl -w kernel.yama.ptrace_scope=0)"
    )
    ways = [
        same_user,
        "give this process CAP_SYS_PTRACE (root has it; a container needs --cap-add=SYS_PTRACE)",
    ]
    if scope == "1":
        ways.append(
            f"create the other process's engine with {_PR_SET_PTRACER_HINT} "
            "(prctl PR_SET_PTRACER_ANY), which lets same-user processes attach to it under ptrace_scope 1"
        )
    return f"{facts} It is allowed if you " + "; or ".join(ways) + "."


def _read_first_line(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.readline().strip()
    except OSError:
        return None


def _status_field(pid: int | str, field: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return line.split()[1:]
    except OSError:
        return None
    return None


def _uid_of(pid: int) -> int | None:
    uids = _status_field(pid, "Uid")
    return int(uids[1]) if uids else None  # the effective uid decides ptrace access


def _has_cap_sys_ptrace() -> bool:
    caps = _status_field("self", "CapEff")
    if not caps:
        return False
    return bool(int(caps[0], 16) >> _CAP_SYS_PTRACE & 1)
