#!/usr/bin/env bash
# Create .venv with xsp-sidecar (editable), its dev tools, the analysis, pytorch and tensorflow
# extras (the tests need them) and the CPU build of PyTorch, and the private Triton environment
# under .triton/. Safe to run again: when nothing that goes into .venv changed (pyproject.toml,
# setup.py and the C extensions it builds, this script, the Python), it only checks the
# environment and says so in one line. pip's output goes to .venv/setup.log, shown on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

STAMP=.venv/.xsp-setup-stamp
LOG=.venv/setup.log
want="$(cat pyproject.toml setup.py scripts/setup.sh sidecar/proxy/*.c sidecar/proxy/*.h | sha256sum | cut -d' ' -f1) $(python -V 2>&1)"
check() { python -c "import sidecar, torch, onnxruntime, grpc, tritonclient.grpc, tensorflow_serving.apis.predict_pb2, pandas, matplotlib, duckdb, pyarrow, adbc_driver_sqlite.dbapi" 2>/dev/null; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && check; then
    echo "==> .venv is up to date (pyproject.toml unchanged; log of the last install: $LOG)"
else
    echo "==> installing xsp-sidecar and its dependencies into .venv (log: $LOG)"
    {
        pip install --quiet --upgrade pip || echo "(pip not upgraded; going on)"
        # The README's dev install line, in one resolution; torch pinned to the CPU build (an
        # unpinned torch would pull a multi-GB CUDA build).
        pip install --quiet -e '.[dev,analysis,pytorch,tensorflow]' torch==2.13.0
    } >"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; echo "setup failed: see $LOG" >&2; exit 1; }
    check || { echo "setup failed: the sidecar's environment is incomplete (see $LOG)" >&2; exit 1; }
    echo "$want" >"$STAMP"
fi
python -m sidecar.proxy.native_check --require --log "$LOG"  # a failed C build fails setup (and CI)

echo "==> preparing the local Triton server (nvidia-pytriton in .triton/venv)"
python -m tests.harness.triton.environment
