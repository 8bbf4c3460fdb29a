#!/usr/bin/env bash
# The GPU suite and bench/gpu_profile.py, on a lent GPU machine (run there from the repo root,
# with `.whl/` from scripts/gpu_wheels.sh carried along). Output and the bench's JSON go to
# $OUT (or ./gpu-check-out). Uses the machine's own PyTorch, numpy and pandas; conftest files
# above each test folder are cut off (they start Triton and TF-Serving, which are not there).
set -uo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupti; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
status=0
python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/gpu -rs tests/gpu \
  2>&1 | tee -a "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/profiling -rs tests/profiling \
  -k "pytorch or cupti" 2>&1 | tee -a "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/analysis tests/analysis/test_analysis_gpu.py \
  2>&1 | tee -a "$OUT/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
python3 bench/gpu_profile.py "$@" 2>&1 | tee "$OUT/gpu_profile.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
