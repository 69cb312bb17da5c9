"""Turn SIGTERM and SIGHUP into KeyboardInterrupt for commands that start servers.

``docker stop``, systemd, ``timeout`` and a closed terminal send these; the default action
kills the process before its ``finally`` blocks could stop the servers it started.
"""

from __future__ import annotations

import signal
import threading


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def stop_on_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, _interrupt)
