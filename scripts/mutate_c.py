"""Mutation check of the relay's C extensions: does a wrong line make a test fail?

For each C source (`sidecar/proxy/_messagewalk.c`, `_pump.c`, `_framewalk.c`) it makes
single-line mutants (a comparison loosened or tightened, `==`/`!=` and `&&`/`||` swapped, a
`+ 1`/`- 1` dropped, a constant moved by one, a `!` dropped, a statement line deleted, a returned
value swapped for its opposite), builds each into the extension of a scratch copy of the repo
(the working tree is never touched), runs that file's C-versus-Python tests there
(`-x -q -p no:cacheprovider`, a timeout per mutant: first under Hypothesis' derandomized
`mutate` profile, a fifth of the examples, then a survivor under `mutate-all`, all of them,
as the `ci` profile draws them; neither shrinks a failure) and
reports the mutants no test caught: `file:line`, the line before and after.

A mutant that does not compile is not counted. One listed in `scripts/mutants_equivalent.txt`
(file, the line's text, the mutated text, and why no input can tell it from the original) is
reported as equivalent and not run. Exit status 1 if any mutant survived.

    python scripts/mutate_c.py                        # all three files
    python scripts/mutate_c.py --file _messagewalk.c  # one
    python scripts/mutate_c.py --sample 40 --budget-seconds 900 --jobs 1
    python scripts/mutate_c.py --list                 # print the mutants, run nothing
    python scripts/mutate_c.py --file _pump.c --lines 120 --grep "== to !=" --no-baseline
                                                      # one mutant (as --list shows it), now

Run it niced on a shared machine: `nice -n 10 .venv/bin/python scripts/mutate_c.py ...`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROXY = "sidecar/proxy"
EQUIVALENT = ROOT / "scripts" / "mutants_equivalent.txt"

# the tests that compare each extension with its Python reference (the fast ones)
TESTS = {
    "_messagewalk.c": ["tests/proxy/test_messagewalk.py"],
    "_pump.c": ["tests/proxy/test_pump.py"],
    "_httppump.c": ["tests/proxy/test_httppump_faults.py", "tests/proxy/test_httppump.py"],
    "_framewalk.c": [
        "tests/proxy/test_model_name_c.py",
        "tests/proxy/test_framewalk.py",
        "tests/proxy/test_framewalk_streams.py",
        "tests/proxy/test_framewalk_counters.py",
        "tests/proxy/test_framewalk_quick.py",
        "tests/proxy/test_framewalk_endings.py",
    ],
}
ORDER = ["_messagewalk.c", "_pump.c", "_framewalk.c", "_httppump.c"]
# sources built into an extension beside its own (vendored, not mutated)
LINKED = {"_httppump.c": ["llhttp/api.c", "llhttp/http.c", "llhttp/llhttp.c"]}

# one token swapped for its opposite wherever it appears (returned values, flags, truth)
SWAPS = {
    "Py_True": "Py_False",
    "Py_False": "Py_True",
    "FLAG_TRUE": "FLAG_FALSE",
    "FLAG_FALSE": "FLAG_TRUE",
    "DONE": "STOP",
    "STOP": "DONE",
    "NAME_FOUND": "NAME_ABSENT",
    "NAME_ABSENT": "NAME_NEED_MORE",
    "NAME_NEED_MORE": "NAME_ABSENT",
    "break": "continue",
    "continue": "break",
}
_SWAP_RE = re.compile(r"\b(" + "|".join(SWAPS) + r")\b")
# operator -> replacements; found on the line with string literals and comments blanked
OPERATORS: list[tuple[str, re.Pattern[str], str]] = [
    ("<= to <", re.compile(r"<="), "<"),
    (">= to >", re.compile(r">="), ">"),
    ("< to <=", re.compile(r"(?<![<-])<(?![<=])"), "<="),
    ("> to >=", re.compile(r"(?<![>-])>(?![>=])"), ">="),
    ("== to !=", re.compile(r"=="), "!="),
    ("!= to ==", re.compile(r"!="), "=="),
    ("&& to ||", re.compile(r"&&"), "||"),
    ("|| to &&", re.compile(r"\|\|"), "&&"),
    ("drop + 1", re.compile(r" \+ 1\b(?!\.)"), ""),
    ("drop - 1", re.compile(r" - 1\b(?!\.)"), ""),
    ("drop !", re.compile(r"!(?!=)"), ""),
]
_NUMBER = re.compile(r"(?<![\w.])(0x[0-9a-fA-F]+|\d+)(?![\w.])")
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'')
# the type and module registration from here to the end of the file: a wrong line there fails
# the import, which every test does first
_REGISTRATION = re.compile(r"^static PyMethodDef\b")
# a GC traverse function (what it visits only matters to the cycle collector)
_TRAVERSE = re.compile(r"^static int \w+_traverse\(")
_DECLARATION = re.compile(
    r"^(static |const |unsigned |signed |struct |enum )*"
    r"(int|char|long|size_t|Py_ssize_t|uint\d+_t|int\d+_t|PyObject|Py_buffer|Scan|Field|Text|"
    r"Response|Walker|double|float|void)\b[\s*]+\w+\s*(=|;|\[|,)"
)


@dataclass(frozen=True)
class Mutant:
    file: str
    line: int  # 1-based
    operator: str
    before: str  # the line's text, stripped
    after: str  # the mutated line's text, stripped
    source: str  # the whole mutated file
    context: str  # the code line before it, stripped (tells apart lines of the same text)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.file, self.before, self.after, self.context)


def _blank(code: str) -> str:
    """The line with string and character literals blanked (same length)."""
    return _STRING.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', code)


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(index, the line's code without comments) of each line worth mutating."""
    out = []
    in_comment = in_traverse = in_macro = False
    for i, raw in enumerate(text.splitlines()):
        line = raw
        if in_comment:
            end = line.find("*/")
            if end < 0:
                continue
            line = " " * (end + 2) + line[end + 2 :]
            in_comment = False
        # drop /* ... */ and // comments (outside strings)
        blanked = _blank(line)
        while True:
            start = blanked.find("/*")
            if start < 0:
                break
            end = blanked.find("*/", start + 2)
            if end < 0:
                line = line[:start]
                blanked = blanked[:start]
                in_comment = True
                break
            line = line[:start] + " " * (end + 2 - start) + line[end + 2 :]
            blanked = blanked[:start] + " " * (end + 2 - start) + blanked[end + 2 :]
        cut = blanked.find("//")
        if cut >= 0:
            line = line[:cut]
        stripped = line.strip()
        if in_macro:
            in_macro = stripped.endswith("\\")
            continue
        if stripped.startswith("#"):
            in_macro = stripped.endswith("\\")
            continue
        if _REGISTRATION.match(stripped):
            break
        if _TRAVERSE.match(stripped):
            in_traverse = True
        if in_traverse:
            in_traverse = stripped != "}"
            continue
        if stripped and not stripped.startswith("enum"):  # enum values: names, renumbered
            out.append((i, line.rstrip()))
    return out


def _is_statement(code: str) -> bool:
    s = code.strip()
    if not s.endswith(";") or s.startswith(("return", "}", "typedef", "enum")):
        return False
    return not _DECLARATION.match(s)


def mutants(file: str, text: str) -> list[Mutant]:
    """Every single-line mutant of one C source."""
    lines = text.splitlines(keepends=True)
    out: list[Mutant] = []
    seen: set[tuple[int, str]] = set()

    previous = ""

    def add(i: int, operator: str, new_code: str, code: str) -> None:
        original = lines[i]
        new_line = original.replace(code.rstrip(), new_code.rstrip(), 1)
        if new_line == original or (i, new_line) in seen:
            return
        seen.add((i, new_line))
        source = "".join(lines[:i]) + new_line + "".join(lines[i + 1 :])
        out.append(Mutant(file, i + 1, operator, code.strip(), new_code.strip(), source, previous))

    for i, code in _code_lines(text):
        blanked = _blank(code)
        for name, pattern, repl in OPERATORS:
            for m in pattern.finditer(blanked):
                add(i, name, code[: m.start()] + repl + code[m.end() :], code)
        for m in _NUMBER.finditer(blanked):
            token = m.group()
            value = int(token, 0)
            new = hex(value + 1) if token.lower().startswith("0x") else str(value + 1)
            add(i, f"constant {token} to {new}", code[: m.start()] + new + code[m.end() :], code)
        for m in _SWAP_RE.finditer(blanked):
            new = SWAPS[m.group()]
            add(i, f"{m.group()} to {new}", code[: m.start()] + new + code[m.end() :], code)
        if _is_statement(code):
            indent = code[: len(code) - len(code.lstrip())]
            add(i, "delete statement", indent + ";", code)
        previous = code.strip()
    return out


def read_equivalent() -> dict[tuple[str, str, str, str], str]:
    """The entries of scripts/mutants_equivalent.txt, one a line:
    `file: line text => mutated text  # why`, or where lines of the same text differ,
    `file: line text => mutated text <- the code line before it  # why`."""
    out: dict[tuple[str, str, str, str], str] = {}
    if not EQUIVALENT.exists():
        return out
    for raw in EQUIVALENT.read_text().splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        entry, _, reason = raw.partition("  # ")
        file, _, rest = entry.partition(": ")
        before, sep, after = rest.partition(" => ")
        after, _, context = after.partition(" <- ")
        if not sep or not reason.strip():
            raise SystemExit(f"{EQUIVALENT.name}: cannot read {raw!r}")
        out[(file.strip(), before.strip(), after.strip(), context.strip())] = reason.strip()
    return out


def is_equivalent(m: Mutant, equivalent: dict[tuple[str, str, str, str], str]) -> bool:
    return m.key in equivalent or (m.file, m.before, m.after, "") in equivalent


# The sanitizer pass (a survivor of both profiles): scripts/sanitize.sh's gcc build and runtime.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-g"]


def _compile_command(source: Path, target: Path, sanitize: bool = False) -> list[str]:
    include = sysconfig.get_paths()["include"]
    return [
        "gcc" if sanitize else sysconfig.get_config_var("CC") or "cc",
        "-shared",
        "-fPIC",
        "-O2",
        "-fwrapv",
        "-DNDEBUG",
        "-w",
        *(SANITIZE_FLAGS if sanitize else []),
        f"-I{include}",
        f"-I{source.parent}",
        str(source),
        *(str(source.parent / extra) for extra in LINKED.get(source.name, ())),
        "-o",
        str(target),
    ]


def _sanitizer_env(reports: Path) -> dict[str, str]:
    """The environment a sanitized build's tests run in: gcc's ASan and UBSan runtimes
    preloaded, every allocation through malloc, the first report ends the run."""
    runtimes = [
        subprocess.run(
            ["gcc", f"-print-file-name={lib}"], capture_output=True, text=True
        ).stdout.strip()
        for lib in ("libasan.so", "libubsan.so")
    ]
    return {
        "LD_PRELOAD": " ".join(runtimes),
        "PYTHONMALLOC": "malloc",
        "ASAN_OPTIONS": f"detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path={reports}/asan",
        "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:log_path={reports}/ubsan",
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Scratch:
    """A copy of the repo whose extension one mutant at a time is rebuilt in."""

    def __init__(self, base: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="mutate-", dir=base))
        ignore = shutil.ignore_patterns(
            ".git", ".venv", ".triton", ".hypothesis", "__pycache__", "*.egg-info", "build"
        )
        for item in ROOT.iterdir():
            if item.name in {".git", ".venv", ".triton", ".hypothesis", "build", "docs", "bench"}:
                continue
            if item.is_dir():
                shutil.copytree(item, self.root / item.name, ignore=ignore, symlinks=True)
            else:
                shutil.copy2(item, self.root / item.name)
        self.suffix = sysconfig.get_config_var("EXT_SUFFIX")

    def build(
        self, file: str, source_text: str, sanitize: bool = False
    ) -> subprocess.CompletedProcess[str]:
        src = self.root / PROXY / file
        src.write_text(source_text)
        target = src.with_name(file[:-2] + self.suffix)
        tmp = target.with_suffix(".tmp")
        done = subprocess.run(
            _compile_command(src, tmp, sanitize), capture_output=True, text=True, timeout=300
        )
        if done.returncode == 0:
            os.replace(tmp, target)  # a new inode: no process maps the old one
        return done

    def test(
        self, file: str, limit: tuple[float, float], profile: str, sanitize: bool = False
    ) -> tuple[str, float, float]:
        """The tests' outcome, wall and CPU seconds. `limit`: (CPU, wall) seconds; a mutant
        that loops for ever is stopped by the CPU limit (a busy machine slows the wall clock,
        not the CPU a run takes), the wall limit is a backstop. `sanitize`: the extension was
        built with the sanitizers (`build(..., sanitize=True)`), whose runtimes are preloaded;
        a report aborts the run ("crashed")."""
        env = dict(os.environ, PYTHONPATH=str(self.root), HYPOTHESIS_PROFILE=profile)
        if sanitize:
            reports = self.root / "sanitizer-reports"
            reports.mkdir(exist_ok=True)
            env.update(_sanitizer_env(reports))
        env.pop("PYTEST_ADDOPTS", None)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        cmd += ["-o", "addopts=", *TESTS[file]]
        cpu = int(limit[0]) + 1

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))

        start = time.monotonic()
        used = _children_cpu()
        try:
            done = subprocess.run(
                cmd, cwd=self.root, env=env, capture_output=True, text=True,
                timeout=limit[1], preexec_fn=cap,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - start, _children_cpu() - used
        took, cpu_took = time.monotonic() - start, _children_cpu() - used
        if done.returncode == 0:
            return "survived", took, cpu_took
        if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            return "timeout", took, cpu_took
        if done.returncode < 0:
            return "crashed", took, cpu_took
        if done.returncode in (2, 3, 4):  # interrupted / internal / usage error: the import
            return "error", took, cpu_took
        return "killed", took, cpu_took

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the scratch copies go too
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", action="append", choices=ORDER, help="a C source (repeatable)")
    parser.add_argument("--sample", type=int, help="run N mutants per file, drawn at random")
    parser.add_argument("--seed", type=int, default=44, help="seed of --sample's draw")
    parser.add_argument("--lines", help="only mutants on these lines: 10-80")
    parser.add_argument(
        "--budget-seconds", type=float, default=0, help="stop starting mutants after"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="mutants run at once (one scratch each)"
    )
    parser.add_argument("--timeout", type=float, default=0, help="CPU s per run (4x baseline)")
    parser.add_argument(
        "--grep", help="only mutants whose --list line contains this text (one mutant, say)"
    )
    parser.add_argument(
        "--only",
        type=Path,
        help="only the mutants this file lists, one a line as a run prints them "
        "(`_framewalk.c:312 constant 5 to 6: ...`): an earlier run's survivors, say",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the unmutated run (limits: --timeout, or 300 s CPU) to check a mutant or two",
    )
    parser.add_argument(
        "--no-sanitize",
        action="store_true",
        help="no third pass: a survivor of both profiles is not rebuilt under ASan/UBSan",
    )
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument("--report", type=Path, help="also write the markdown table here")
    parser.add_argument("--scratch", type=Path, default=None, help="where the scratch copies go")
    args = parser.parse_args()

    files = args.file or ORDER
    equivalent = read_equivalent()
    plan: list[Mutant] = []
    counts: dict[str, dict[str, int]] = {}
    for file in files:
        made = mutants(file, (ROOT / PROXY / file).read_text())
        if args.lines:
            lo, _, hi = args.lines.partition("-")
            made = [m for m in made if int(lo) <= m.line <= int(hi or lo)]
        if args.grep:
            made = [m for m in made if args.grep in _listing(m)]
        if args.only:
            wanted = {line.strip() for line in args.only.read_text().splitlines()}
            made = [m for m in made if _progress(m) in wanted]
        counts[file] = {"generated": len(made)}
        if args.sample and args.sample < len(made):
            made = random.Random(f"{args.seed}{file}").sample(made, args.sample)
            made.sort(key=lambda m: m.line)
        plan += made
    if args.list:
        for m in plan:
            tag = "  [equivalent]" if is_equivalent(m, equivalent) else ""
            print(_listing(m) + tag)
        print(f"{len(plan)} mutants", file=sys.stderr)
        return 0

    base = args.scratch or Path(tempfile.gettempdir())
    scratches = [Scratch(base) for _ in range(max(1, args.jobs))]
    results: dict[Mutant, tuple[str, float]] = {}
    try:
        limits: dict[tuple[str, str], tuple[float, float]] = {}
        for file in files:  # the unmutated sources must build and pass first
            built = scratches[0].build(file, (ROOT / PROXY / file).read_text())
            if built.returncode:
                print(built.stderr, file=sys.stderr)
                raise SystemExit(f"{file}: the unmutated source does not build")
            for profile in ("mutate", "mutate-all"):
                if args.no_baseline:
                    limits[file, profile] = (args.timeout or 300.0, 3600.0)
                    continue
                outcome, took, cpu = scratches[0].test(file, (3600, 3600), profile)
                if outcome != "survived":
                    raise SystemExit(f"{file}: the tests fail without a mutant ({outcome})")
                limits[file, profile] = (
                    args.timeout or max(20.0, 4 * cpu),
                    max(120.0, 10 * took, 2 * args.timeout),
                )
                print(
                    f"baseline {file} ({profile} profile): tests pass in {took:.1f}s, "
                    f"{cpu:.1f}s CPU; limits {limits[file, profile][0]:.0f}s CPU, "
                    f"{limits[file, profile][1]:.0f}s"
                )
        for scratch in scratches[1:]:
            for file in files:
                scratch.build(file, (ROOT / PROXY / file).read_text())

        start = time.monotonic()
        todo = [m for m in plan if not is_equivalent(m, equivalent)]
        for m in plan:
            if is_equivalent(m, equivalent):
                results[m] = ("equivalent", 0.0)
        total = len(todo)
        done_count = 0

        def run_one(m: Mutant, scratch: Scratch) -> tuple[str, float]:
            built = scratch.build(m.file, m.source)
            try:
                if built.returncode:
                    return "no-compile", 0.0
                # first the `mutate` profile's fifth of the examples; a survivor then faces all
                outcome, took, _ = scratch.test(m.file, limits[m.file, "mutate"], "mutate")
                if outcome != "survived":
                    return outcome, took
                outcome, more, _ = scratch.test(m.file, limits[m.file, "mutate-all"], "mutate-all")
                took += more
                if outcome != "survived" or args.no_sanitize:
                    return outcome, took
                # a survivor of both: a memory or UB error only a sanitizer sees, as CI's
                # sanitizer step would (scripts/sanitize.sh); the `mutate` profile's examples
                if scratch.build(m.file, m.source, sanitize=True).returncode:
                    return "survived", took
                cpu, wall = limits[m.file, "mutate"]
                outcome, more, _ = scratch.test(m.file, (3 * cpu, 3 * wall), "mutate", True)
                # only a report (an abort) or a failing test counts; an import error or a
                # slow run under the sanitizers is no kill
                verdict = {"crashed": "sanitized", "killed": "killed"}.get(outcome, "survived")
                return verdict, took + more
            finally:
                scratch.build(m.file, (ROOT / PROXY / m.file).read_text())

        free = list(scratches)
        with ThreadPoolExecutor(len(scratches)) as pool:
            pending: dict[Any, tuple[Mutant, Scratch]] = {}
            queue = list(todo)
            while queue or pending:
                while queue and free:
                    if args.budget_seconds and time.monotonic() - start > args.budget_seconds:
                        queue.clear()
                        break
                    m = queue.pop(0)
                    scratch = free.pop()
                    pending[pool.submit(run_one, m, scratch)] = (m, scratch)
                if not pending:
                    break
                finished = next(iter(f for f in pending if f.done()), None)
                if finished is None:
                    time.sleep(0.05)
                    continue
                m, scratch = pending.pop(finished)
                free.append(scratch)
                results[m] = finished.result()
                done_count += 1
                outcome, took = results[m]
                elapsed = time.monotonic() - start
                mark = "SURVIVED " if outcome == "survived" else ""
                print(
                    f"[{done_count}/{total} {elapsed:5.0f}s] {mark}{outcome:10} {took:5.1f}s "
                    + _progress(m),
                    flush=True,
                )
    finally:
        for scratch in scratches:
            scratch.close()

    report = render(files, counts, plan, results, equivalent)
    print(report)
    if args.report:
        args.report.write_text(report)
    return 1 if any(o == "survived" for o, _ in results.values()) else 0


def _progress(m: Mutant) -> str:
    """The mutant as a run's progress lines name it (what `--only` reads)."""
    return f"{m.file}:{m.line} {m.operator}: {m.after}"


def _listing(m: Mutant) -> str:
    return f"{m.file}:{m.line}: {m.operator}: {m.before} => {m.after} <- {m.context}"


def render(
    files: list[str],
    counts: dict[str, dict[str, int]],
    plan: list[Mutant],
    results: dict[Mutant, tuple[str, float]],
    equivalent: dict[tuple[str, str, str, str], str],
) -> str:
    rows = ["| file | generated | planned | run | killed | equivalent | no compile | survived |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for file in files:
        mine = [m for m in plan if m.file == file]
        got = [results[m][0] for m in mine if m in results]
        killed = sum(o in ("killed", "crashed", "sanitized", "timeout", "error") for o in got)
        rows.append(
            f"| {file} | {counts[file]['generated']} | {len(mine)} | "
            f"{sum(o != 'equivalent' for o in got)} | {killed} | {got.count('equivalent')} | "
            f"{got.count('no-compile')} | {got.count('survived')} |"
        )
    survivors = [m for m in plan if results.get(m, ("",))[0] == "survived"]
    lines = ["", *rows, ""]
    if survivors:
        lines += ["Survivors:", "", "| where | mutation | line after |", "|---|---|---|"]
        for m in survivors:
            after = m.after.replace("|", "\\|")
            lines.append(f"| {m.file}:{m.line} | {m.operator} | `{after}` |")
        lines += ["", "As entries for scripts/mutants_equivalent.txt, where one is equivalent:", ""]
        lines += [f"    {m.file}: {m.before} => {m.after} <- {m.context}  # why" for m in survivors]
    else:
        lines.append("No mutant survived.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
