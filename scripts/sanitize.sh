#!/usr/bin/env bash
# The relay's C extensions under AddressSanitizer and UndefinedBehaviorSanitizer (gcc's).
#
# Builds _framewalk, _pump and _messagewalk with -fsanitize=address,undefined in a scratch copy
# of the tree (the checkout's own .so files are left as they are), then, with the sanitizer
# runtimes preloaded (PYTHONMALLOC=malloc so ASan sees every allocation), halting on the first
# report, runs from that copy:
#   1. the C-against-Python property tests (frame walk, stream bookkeeping, pump, message
#      walk, model name, the fuzz corpora) and real gRPC calls through a relay to a grpcio
#      backend (test_pump's unary calls, sampling off and on; a stream, test_proxy_relay's);
#   2. every fuzz target (scripts/fuzz.sh) on its seed corpus and on SANITIZE_CORPUS/<target>/
#      (a coverage-guided run's grown corpus: scripts/fuzz.sh's FUZZ_WORK/corpus) where given.
#      Under gcc's ASan runtime atheris gets no coverage feedback (the runtime, not libFuzzer,
#      provides the coverage symbols), so here the targets replay the corpora, and in the long
#      form also mutate them blindly; see docs/testing.md.
#
#   bash scripts/sanitize.sh --ci    # bounded (CI): the tests once, the corpora replayed
#   bash scripts/sanitize.sh         # long form: SANITIZE_BUDGET seconds (default 1800): half
#                                    # in rounds of the property tests with fresh seeds, then
#                                    # each fuzz target SANITIZE_BUDGET/10 seconds
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

ci=0
if [ "${1:-}" = "--ci" ]; then
    ci=1
fi
budget="${SANITIZE_BUDGET:-1800}"
corpus_extra=""
[ -z "${SANITIZE_CORPUS:-}" ] || corpus_extra="$(cd "$SANITIZE_CORPUS" && pwd)"

# shellcheck disable=SC1091
. .venv/bin/activate
python -c "import atheris" 2>/dev/null || pip install --quiet "atheris>=2.3" >&2

scratch="$(mktemp -d "${TMPDIR:-/tmp}/xsp-sanitize.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
echo "==> sanitizers: copying the tree to $scratch"
git ls-files -z --cached --others --exclude-standard \
    | python -c 'import os, sys; sys.stdout.buffer.write(b"".join(p + b"\0" for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.isfile(p)))' \
    | tar --null -T - -cf - | tar -xf - -C "$scratch"

echo "==> sanitizers: building the C extensions with -fsanitize=address,undefined"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
(cd "$scratch" && CC=gcc CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    python setup.py --quiet build_ext --inplace >build.log 2>&1) \
    || { cat "$scratch/build.log" >&2; echo "sanitizer build failed" >&2; exit 1; }
for ext in _framewalk _pump _messagewalk; do
    so=$(ls "$scratch"/sidecar/proxy/"$ext".*.so 2>/dev/null || true)
    if [ -z "$so" ] || ! nm -D "$so" | grep -q __asan_init; then
        cat "$scratch/build.log" >&2
        echo "sanitizer build failed: no sanitized $ext was built" >&2
        exit 1
    fi
done

export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export PYTHONPATH="$scratch"
cd "$scratch"
# the sanitized build must be what the tests import, not the checkout's
python - <<'PY'
import os, sys
from sidecar.proxy import _framewalk, _messagewalk, _pump
for mod in (_framewalk, _pump, _messagewalk):
    assert mod.__file__.startswith(os.environ["PYTHONPATH"]), mod.__file__
print("    sanitized extensions imported from the scratch copy")
PY

tests=(tests/proxy/test_framewalk.py tests/proxy/test_framewalk_streams.py
    tests/proxy/test_pump.py tests/proxy/test_messagewalk.py tests/proxy/test_model_name_c.py
    tests/proxy/test_fuzz_regressions.py
    tests/proxy/test_proxy_relay.py::test_unix_socket_backend_and_streaming)
start=$(date +%s)
echo "==> sanitizers: the C-against-Python tests and a real relay exchange"
python -m pytest -x -q -p no:cacheprovider "${tests[@]}"
if [ "$ci" = 0 ]; then
    round=1
    while [ $(($(date +%s) - start)) -lt $((budget / 2)) ]; do
        seed=$RANDOM$RANDOM
        echo "==> sanitizers: property tests, round $round (--hypothesis-seed=$seed)"
        python -m pytest -x -q -p no:cacheprovider --hypothesis-seed="$seed" "${tests[@]}"
        round=$((round + 1))
    done
fi

seconds=0
[ "$ci" = 1 ] || seconds=$((budget / 10))
echo "==> sanitizers: the fuzz targets"
fuzzwork="$(mktemp -d "${TMPDIR:-/tmp}/xsp-fuzz.XXXXXX")"  # kept on failure: the reproducers
FUZZ_SECONDS="$seconds" FUZZ_WORK="$fuzzwork" FUZZ_CORPUS_EXTRA="$corpus_extra" bash "$scratch/scripts/fuzz.sh"
rm -rf "$fuzzwork"
echo "==> sanitizers: no error in $(($(date +%s) - start)) s"
