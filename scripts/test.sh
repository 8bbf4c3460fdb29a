#!/usr/bin/env bash
# Set up everything from scratch (idempotent) and run the linters and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

# Headless Chromium renders the HTML report in one test (installed when we are root).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "==> installing chromium for the HTML report test"
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
        || echo "warning: chromium could not be installed; the HTML screenshot test will be skipped"
fi

# clang and its compiler-rt let scripts/sanitize.sh fuzz the sanitized C coverage-guided (it
# falls back to gcc, whose ASan runtime leaves the fuzzers without coverage feedback).
if ! command -v clang >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "==> installing clang and compiler-rt for the sanitizer step"
    (apt-get update -qq && apt-get install -y -qq clang libclang-rt-dev >/dev/null) \
        || echo "warning: clang could not be installed; scripts/sanitize.sh will use gcc"
fi

# A real Prometheus runs the Grafana dashboard's queries (tests/deploy/test_dashboard_metrics_live.py)
# and socat is the byte-copying floor the relay benches compare against (bench/proxy_overhead.py).
if { ! command -v prometheus >/dev/null 2>&1 || ! command -v socat >/dev/null 2>&1; } \
    && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    echo "==> installing prometheus and socat for the dashboard and relay-floor checks"
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus socat >/dev/null) \
        || echo "warning: prometheus/socat could not be installed; their checks will be skipped"
fi

# shellcheck disable=SC1091
. .venv/bin/activate
echo "==> ruff"
ruff check .
ruff format --check .
echo "==> mypy"
mypy sidecar analysis tests/harness
echo "==> pytest"
if [ "$#" -eq 0 ]; then
    pytest -q --durations=30 --durations-min=20  # the slowest, to keep CI within its budget
else
    pytest -q "$@"
fi
# The relay's pure-Python paths are a product too (no compiler at install): the relay's and the
# sampling hook's tests again with every C path off (about 3 min on 2 busy cores, 351 tests; the
# C-vs-Python comparisons skip). Then the relay's C parsers (issue 44), bounded: every fuzz
# target on the normal build, and the C-against-Python tests, relay exchanges and fuzz targets
# under ASan and UBSan (long forms: docs/testing.md). Both only for the whole suite (not when
# pytest is given arguments).
if [ "$#" -eq 0 ]; then
    echo "==> pytest tests/proxy tests/sampling, the relay's C paths off (XSP_NATIVE=off)"
    XSP_NATIVE=off pytest -q tests/proxy tests/sampling
    echo "==> sanitizers and fuzzing (scripts/sanitize.sh --ci)"
    bash scripts/sanitize.sh --ci
fi
