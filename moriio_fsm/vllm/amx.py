"""Ask Linux for the AMX tile state permission before the first forward on a CPU with AMX.

vLLM's CPU attention kernel runs AMX instructions without asking for the permission
Linux requires (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); a process whose
first forward has one token (a decode instance that loaded the whole prompt) then dies
with SIGILL. Asking is harmless where AMX is absent: the call fails and nothing changes.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """True when this process may now use AMX tiles (granted now or before)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
