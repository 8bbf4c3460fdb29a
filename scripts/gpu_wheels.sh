#!/usr/bin/env bash
# Wheels a lent GPU machine (see README "GPU check") lacks, for its Python 3.12, into .whl/:
# cupti-python 13.0.1 (matches the CUDA 13.0 driver's CUPTI) and the few pure-Python packages
# the GPU tests, the report and bench/gpu_profile.py import that its image does not hold.
# Run here (where pip reaches the registry); `.whl/` is git-ignored and carried to the device.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl -q)
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
python3 -m pip download "${args[@]}" \
  cupti-python==13.0.1 cxxfilt==0.3.0 sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4 \
  duckdb==2.0.1 adbc-driver-manager==1.13.0 adbc-driver-sqlite==1.13.0 \
  pandas==2.3.3 pytz==2025.2 tzdata==2025.2
ls -1 .whl
du -sh .whl
