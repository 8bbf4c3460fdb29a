#!/usr/bin/env bash
# The GPU suite and bench/gpu_profile.py, on a lent GPU machine (run there from the repo root,
# with `.whl/` from scripts/gpu_wheels.sh carried along). Output and logs go to $OUT (or
# ./gpu-check-out). Uses the machine's own PyTorch and numpy, and the carried pandas 2 (the
# project pins pandas<3; the image's pandas 3 fails the analyses); conftest files above each
# test folder are cut off (they start Triton and TF-Serving, which are not there).
#
#   bash scripts/gpu_check.sh tests               the GPU tests (a few minutes)
#   bash scripts/gpu_check.sh bench [ARGS...]     bench/gpu_profile.py ARGS (e.g. --no-ncu,
#                                                 --cases resnet50:64,bert:8)
#   bash scripts/gpu_check.sh overhead [ARGS...]  bench/gpu_kernel_overhead.py ARGS (K's
#                                                 overhead split: hooks, CUPTI; each variant
#                                                 in fresh processes, ~10 s a process)
#   bash scripts/gpu_check.sh after-cupti [ARGS...]  bench/gpu_after_cupti.py ARGS (does a
#                                                 process that ran CUPTI stay slower, and
#                                                 does cupti.finalize() clear it; ~3 minutes)
#   bash scripts/gpu_check.sh                     all four: overhead and after-cupti on
#                                                 resnet50:8, tests, bench --no-ncu on
#                                                 resnet50:8,resnet50:64,bert:8 (the goals'
#                                                 cases), each under a timeout: one 10-min call
#
# Each part appends to its own log, so a call stopped at its limit still returns what ran.
set -uo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
part=${1:-all}
[ $# -gt 0 ] && shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, cupti; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
status=0
if [ "$part" = all ]; then  # each part bounded, so one 10-minute call returns all four
  limit_overhead=150 limit_after=130 limit_test=80 limit_bench=200
  overhead_args=(--cases resnet50:8 --rounds 3) after_args=(--cases resnet50:8 --rounds 3)
  bench_args=(--no-ncu --cases resnet50:8,resnet50:64,bert:8)
else
  limit_overhead=600 limit_after=600 limit_test=600 limit_bench=600
  overhead_args=("$@") after_args=("$@") bench_args=("$@")
fi
run_pytest() {  # one pytest process per call: a process keeps the first CUPTI client it used
  timeout "$limit_test" python3 -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 \
    | tee -a "$OUT/pytest.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
if [ "$part" = overhead ] || [ "$part" = all ]; then
  timeout "$limit_overhead" python3 bench/gpu_kernel_overhead.py "${overhead_args[@]}" 2>&1 \
    | tee -a "$OUT/gpu_kernel_overhead.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$part" = after-cupti ] || [ "$part" = all ]; then
  timeout "$limit_after" python3 bench/gpu_after_cupti.py "${after_args[@]}" 2>&1 \
    | tee -a "$OUT/gpu_after_cupti.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$part" = tests ] || [ "$part" = all ]; then
  # The live CUDA runner test first and alone: the CPU kernel-level tests claim CUPTI for
  # torch.profiler on a CUDA build of PyTorch, after which it would skip itself.
  cuda_test=tests/profiling/test_profiling_pytorch.py::test_cuda_levels_on_a_gpu
  run_pytest --confcutdir=tests/profiling "$cuda_test"
  run_pytest --confcutdir=tests/gpu tests/gpu
  # test_server_config reads Triton's and TF-Serving's config protos (tritonclient, tensorflow),
  # which that image lacks; it runs no GPU code.
  run_pytest --confcutdir=tests/profiling tests/profiling -k "pytorch or cupti or onnxruntime" \
    --deselect "$cuda_test" --ignore=tests/profiling/test_server_config.py
  run_pytest --confcutdir=tests/analysis tests/analysis/test_analysis_gpu.py
fi
if [ "$part" = bench ] || [ "$part" = all ]; then
  timeout "$limit_bench" python3 bench/gpu_profile.py "${bench_args[@]}" 2>&1 \
    | tee -a "$OUT/gpu_profile.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
