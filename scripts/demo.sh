#!/usr/bin/env bash
# Set up (idempotent), then run the demo: local Triton + sidecar + traffic + profiles + report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec xsp-sidecar demo "$@"
