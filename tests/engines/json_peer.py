"""A peer process spoken to in JSON lines, for the cross-process engine tests.

Rules: every read is bounded by select; ``stop`` kills the process by its pid, reaps it and closes its pipes,
and may be called any number of times.
"""

import json
import os
import select
import signal
import subprocess
import sys


class JsonLinePeer:
    """``python SCRIPT ARGS...``; its first line is kept as ``hello``."""

    def __init__(self, script: str, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.process.pid
        self.hello = self.read()

    def read(self, timeout_s: float = 60.0) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(
                f"peer process {self.pid} did not answer (exit code {self.process.poll()})"
            )
        return json.loads(line)

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def dump(self, offset: int, size: int) -> bytes:
        return bytes.fromhex(self.ask(op="dump", offset=offset, size=size)["hex"])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(30)
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()
