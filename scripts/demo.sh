#!/usr/bin/env bash
# Set up (idempotent), then run the demo: local Triton + sidecar + traffic + profiles + report.
# `--backend tfserving`: the same on the stand-in for tensorflow_model_server (Keras models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# the demo is part of the test harness (tests/harness/demo/), not of the installed package
exec python -m tests.harness.demo "$@"
