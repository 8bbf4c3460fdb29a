#!/usr/bin/env bash
# The relay's C extensions under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds _framewalk, _pump, _messagewalk and _httppump with -fsanitize=address,undefined in a scratch copy
# of the tree (the checkout's own .so files are left as they are), then, with the sanitizer
# runtimes preloaded (PYTHONMALLOC=malloc so ASan sees every allocation), halting on the first
# report, runs from that copy:
#   1. the C-against-Python property tests (frame walk, stream bookkeeping, pump, message
#      walk, model name, the HTTP pump, the fuzz corpora) and real gRPC calls through a relay to a grpcio
#      backend (test_pump's unary calls, sampling off and on; a stream, test_proxy_relay's);
#   2. every fuzz target (scripts/fuzz.sh) on its seed corpus and on SANITIZE_CORPUS/<target>/
#      (a coverage-guided run's grown corpus: scripts/fuzz.sh's FUZZ_WORK/corpus) where given;
#      with --ci and no SANITIZE_CORPUS, scripts/fuzz.sh --ci runs on the normal build during 1
#      and its corpus is used.
#      Built with clang, the fuzzing is coverage-guided by the C and the Python; built with gcc
#      (no clang here) it is not (see below), and CI only replays the corpora.
#
#   bash scripts/sanitize.sh --ci    # bounded (CI): the tests once (Hypothesis' `sanitize`
#                                    # profile: 40 % of the examples), each target 10 s
#   bash scripts/sanitize.sh         # long form: SANITIZE_BUDGET seconds (default 1800): half
#                                    # in rounds of the property tests with fresh seeds, then
#                                    # each fuzz target SANITIZE_BUDGET/10 seconds
set -euo pipefail
cd "$(dirname "$0")/.."

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
# The sanitizers' reports go to files (pytest captures stderr, and an abort loses what it held),
# printed when the script fails.
plain=""
finish() {
    status=$?
    if [ -n "$plain" ] && kill -0 "$plain" 2>/dev/null; then
        kill $(pgrep -P "$plain") "$plain" 2>/dev/null || true
    fi
    if [ "$status" != 0 ] && compgen -G "$scratch/reports/*" >/dev/null; then
        echo "==> sanitizer reports" >&2
        cat "$scratch"/reports/* >&2
    fi
    rm -rf "$scratch"
    exit "$status"
}
trap finish EXIT
echo "==> sanitizers: copying the tree to $scratch"
git ls-files -z --cached --others --exclude-standard \
    | python -c 'import os, sys; sys.stdout.buffer.write(b"".join(p + b"\0" for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.isfile(p)))' \
    | tar --null -T - -cf - | tar -xf - -C "$scratch"

# --ci without SANITIZE_CORPUS: scripts/fuzz.sh --ci on the checkout's normal build runs on the
# other core meanwhile (the sanitized tests take one), and its grown corpus is replayed and
# fuzzed further under the sanitizers below.
if [ "$ci" = 1 ] && [ -z "$corpus_extra" ]; then
    plainwork="$(mktemp -d "${TMPDIR:-/tmp}/xsp-fuzz.XXXXXX")"  # kept on failure
    echo "==> fuzzing the normal build meanwhile (scripts/fuzz.sh --ci; log: $plainwork/out.log)"
    FUZZ_WORK="$plainwork" bash scripts/fuzz.sh --ci >"$plainwork/out.log" 2>&1 &
    plain=$!
    corpus_extra="$plainwork/corpus"
fi

# clang (with its compiler-rt) where installed: the extensions also get libFuzzer's coverage
# instrumentation (-fsanitize=fuzzer-no-link), and ASan's runtime is merged with libFuzzer (as
# atheris' setup does) so the fuzz targets are coverage-guided by the C itself. gcc otherwise:
# the same sanitizers, but gcc's ASan runtime breaks atheris' coverage feedback, so the fuzz
# targets only replay the corpora (and, in the long form, mutate them blindly).
cc="${SANITIZE_CC:-$(command -v clang || command -v clang-14 || echo gcc)}"
rt=""
if [ "$(basename "$cc")" != gcc ]; then
    rt="$("$cc" -print-resource-dir)/lib/linux"
    [ -f "$rt/libclang_rt.fuzzer_no_main-x86_64.a" ] || { echo "    no compiler-rt for $cc"; cc=gcc; }
fi
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
if [ "$cc" = gcc ]; then
    preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
    guided=0
else
    flags="$flags -fsanitize=fuzzer-no-link"
    cp "$rt/libclang_rt.asan-x86_64.a" "$scratch/asan.a"
    ar d "$scratch/asan.a" asan_preinit.cpp.o  # a shared object has no .preinit_array
    "${cc/clang/clang++}" -Wl,--whole-archive "$rt/libclang_rt.fuzzer_no_main-x86_64.a" \
        "$scratch/asan.a" -Wl,--no-whole-archive -lpthread -ldl -shared \
        -o "$scratch/asan_with_fuzzer.so"
    preload="$scratch/asan_with_fuzzer.so"  # ASan's runtime holds UBSan's handlers too
    guided=1
fi
echo "==> sanitizers: building the C extensions with $(basename "$cc") $flags"
(cd "$scratch" && CC="$cc" CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    python setup.py --quiet build_ext --inplace >build.log 2>&1) \
    || { cat "$scratch/build.log" >&2; echo "sanitizer build failed" >&2; exit 1; }
for ext in _framewalk _pump _messagewalk _httppump; do
    so=$(ls "$scratch"/sidecar/proxy/"$ext".*.so 2>/dev/null || true)
    if [ -z "$so" ] || ! nm -D "$so" | grep -c __asan_init >/dev/null; then
        cat "$scratch/build.log" >&2
        echo "sanitizer build failed: no sanitized $ext was built" >&2
        exit 1
    fi
done

export LD_PRELOAD="$preload"
export PYTHONMALLOC=malloc
mkdir -p "$scratch/reports"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$scratch/reports/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$scratch/reports/ubsan"
export PYTHONPATH="$scratch"
cd "$scratch"
# the sanitized build must be what the tests import, not the checkout's
python - <<'PY'
import os
from sidecar.proxy import _framewalk, _httppump, _messagewalk, _pump
for mod in (_framewalk, _pump, _messagewalk, _httppump):
    assert mod.__file__.startswith(os.environ["PYTHONPATH"]), mod.__file__
print("    sanitized extensions imported from the scratch copy")
PY

tests=(tests/proxy/test_framewalk.py tests/proxy/test_framewalk_streams.py
    tests/proxy/test_framewalk_counters.py tests/proxy/test_framewalk_quick.py
    tests/proxy/test_framewalk_endings.py tests/proxy/test_pump.py tests/proxy/test_messagewalk.py tests/proxy/test_model_name_c.py
    tests/proxy/test_httppump.py tests/proxy/test_httppump_faults.py tests/proxy/test_fuzz_regressions.py
    tests/proxy/test_proxy_relay.py::test_unix_socket_backend_and_streaming)
# shellcheck disable=SC2206
[ -z "${SANITIZE_TESTS:-}" ] || tests=($SANITIZE_TESTS)  # a narrower selection, while developing
start=$(date +%s)
echo "==> sanitizers: the C-against-Python tests and a real relay exchange"
# CI: the `sanitize` profile, two fifths of the examples (the full count ran unsanitized in the
# suite just before; the fuzz targets below explore further, guided by coverage)
profile="${HYPOTHESIS_PROFILE:-ci}"
[ "$ci" = 0 ] || profile="${HYPOTHESIS_PROFILE:-sanitize}"
HYPOTHESIS_PROFILE="$profile" python -m pytest -x -q -p no:cacheprovider "${tests[@]}"
if [ "$ci" = 0 ]; then
    round=1
    while [ $(($(date +%s) - start)) -lt $((budget / 2)) ]; do
        seed=$RANDOM$RANDOM
        echo "==> sanitizers: property tests, round $round (--hypothesis-seed=$seed)"
        python -m pytest -x -q -p no:cacheprovider --hypothesis-seed="$seed" "${tests[@]}"
        round=$((round + 1))
    done
fi

if [ -n "$plain" ]; then
    if wait "$plain"; then
        plain=""
        cat "$plainwork/out.log"
    else
        plain=""
        cat "$plainwork/out.log" >&2
        echo "fuzzing the normal build failed" >&2
        exit 1
    fi
fi
seconds=$((guided * 10))  # CI: coverage-guided 10 s each, or the corpora replayed
[ "$ci" = 1 ] || seconds=$((budget / 10))
echo "==> sanitizers: the fuzz targets"
fuzzwork="$(mktemp -d "${TMPDIR:-/tmp}/xsp-fuzz.XXXXXX")"  # kept on failure: the reproducers
FUZZ_SECONDS="$seconds" FUZZ_WORK="$fuzzwork" FUZZ_CORPUS_EXTRA="$corpus_extra" bash "$scratch/scripts/fuzz.sh"
rm -rf "$fuzzwork" "${plainwork:-}"
echo "==> sanitizers: no error in $(($(date +%s) - start)) s"
