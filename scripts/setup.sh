#!/usr/bin/env bash
# Create .venv with xsp-sidecar (editable), its dev tools and the CPU build of PyTorch,
# and the private Triton environment under .triton/. Safe to run again.
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
echo "==> installing xsp-sidecar and its dependencies into .venv"
pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
# The CPU build of PyTorch first: an unpinned torch would pull a multi-GB CUDA build.
pip install --quiet torch==2.13.0 2>&1 | grep -v "is ignored" || true
pip install --quiet -e '.[dev,pytorch]' 2>&1 | grep -v "is ignored" || true
python -c "import sidecar, torch, onnxruntime, grpc, tritonclient.grpc" \
    || { echo "setup failed: the sidecar's environment is incomplete" >&2; exit 1; }

echo "==> preparing the local Triton server (nvidia-pytriton in .triton/venv)"
python -m sidecar.localtriton.environment
