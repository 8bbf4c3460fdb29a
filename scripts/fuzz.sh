#!/usr/bin/env bash
# Run every fuzz target (tests/fuzz/fuzz_*.py: each compares a C parser of the relay with its
# Python reference) under atheris for a while, starting from the checked-in seed corpora.
#
#   bash scripts/fuzz.sh                 # each target FUZZ_SECONDS (default 60) seconds
#   bash scripts/fuzz.sh --ci            # each target 10 s (CI's bounded run)
#   FUZZ_SECONDS=3600 bash scripts/fuzz.sh framewalk pump   # the long form, some targets
#
# New inputs that grow coverage go to a scratch corpus (FUZZ_WORK, default a temporary
# folder), never into tests/fuzz/corpus/. A crash or a mismatch stops that target, prints the
# reproducer's path (FUZZ_WORK/artifacts/...) and makes this script fail; turn the input into
# a test in tests/proxy/test_fuzz_regressions.py. FUZZ_CORPUS_EXTRA=DIR adds DIR/<target>/
# (another run's grown corpus) to the seeds; FUZZ_SECONDS=0 only replays the corpora, once.
# scripts/sanitize.sh runs this same script under ASan and UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-60}"
if [ "${1:-}" = "--ci" ]; then
    seconds="${FUZZ_SECONDS:-10}"
    shift
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(framewalk pump messagewalk model_name hpack httppump)

if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
# atheris belongs in the dev extra; installed here until it is there
python -c "import atheris" 2>/dev/null || pip install --quiet "atheris>=2.3" >&2

work="${FUZZ_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/xsp-fuzz.XXXXXX")}"
mkdir -p "$work/artifacts"
echo "==> fuzzing ${targets[*]}: ${seconds} s each (scratch corpus and artifacts: $work)"
status=0
for target in "${targets[@]}"; do
    mkdir -p "$work/corpus/$target"
    log="$work/$target.log"
    start=$(date +%s)
    dirs=("$work/corpus/$target" "tests/fuzz/corpus/$target")
    extra="${FUZZ_CORPUS_EXTRA:-}/$target"
    [ -z "${FUZZ_CORPUS_EXTRA:-}" ] || [ ! -d "$extra" ] || dirs+=("$extra")
    how=(-max_total_time="$seconds")
    [ "$seconds" != 0 ] || how=(-runs=0)
    if python -m "tests.fuzz.fuzz_$target" "${dirs[@]}" "${how[@]}" \
        -timeout=25 -rss_limit_mb=8192 -print_final_stats=1 \
        -artifact_prefix="$work/artifacts/$target-" >"$log" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
        cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n1 || true)
        inputs=$(find "${dirs[@]}" -type f | wc -l)
        echo "    $target: ok, ${runs:-?} runs in $(($(date +%s) - start)) s," \
            "${cov:-no coverage feedback (see docs/testing.md)}, corpus $inputs inputs"
    else
        status=1
        echo "    $target: FAILED (log: $log)" >&2
        grep -v '^#\|^INFO' "$log" | tail -n 60 >&2
        ls "$work/artifacts/$target-"* 2>/dev/null | sed 's/^/    reproducer: /' >&2 || true
    fi
done
exit $status
