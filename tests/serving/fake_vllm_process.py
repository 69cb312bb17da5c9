"""A stand-in for vLLM's OpenAI server process, for the launcher's and serve-pd's tests: it
writes the arguments and the VLLM_HOST_IP it was started with to ``$FAKE_VLLM_RECORDS/<port>.json``
and answers ``GET /health`` on its ``--host``/``--port`` until it is stopped.

Run as ``python fake_vllm_process.py <vLLM's arguments>``; ``fake_python`` writes a launcher
script that stands for vLLM's python: it starts this file for the server and passes every
other call (``-c`` probes) to the real interpreter.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def fake_python(folder: Path) -> Path:
    """An executable that stands for vLLM's python; records go to ``folder``."""
    script = folder / "fake-python"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = "vllm.entrypoints.openai.api_server" ]; then\n'
        f'  shift 2; exec {sys.executable} {Path(__file__).resolve()} "$@"\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def main(argv: list[str]) -> None:
    host, port = option(argv, "--host"), int(option(argv, "--port"))
    record = {"argv": argv, "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP")}
    if "--kv-transfer-config" in argv:
        record["kv_transfer_config"] = json.loads(option(argv, "--kv-transfer-config"))
    Path(os.environ["FAKE_VLLM_RECORDS"], f"{port}.json").write_text(json.dumps(record))
    HTTPServer((host, port), Health).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
