"""Every script under bench/ starts, runs at a toy size and prints its figures.

Not a timing: a bench that no longer runs (a moved module, a renamed option) fails here, in
CI, instead of the next time someone wants its numbers. `SMOKE` names one toy run per script;
a script with no entry fails `test_every_bench_script_has_a_smoke_run`. Scripts that start a
real Triton are marked `triton` and `slow`; the soak has its own short run
(test_soak_short.py) and the relay shim runs under relay_breakdown.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


@dataclass(frozen=True)
class Smoke:
    args: tuple[str, ...]
    expect: tuple[str, ...]  # text each run prints (its figures)
    triton: bool = False
    timeout: float = 180.0


SMOKE: dict[str, Smoke] = {
    "report_speed.py": Smoke(
        ("--traces", "8", "--layers", "6", "--format", "json"),
        ("generated 8 traces", "full report (json):", "spans/s", "peak"),
    ),
    "report_speed.py --against": Smoke(
        ("--traces", "8", "--layers", "6", "--format", "json", "--against", str(REPO)),
        ("full report (json), this tree:", f"full report (json), {REPO}:"),
    ),
    "report_speed.py --export": Smoke(
        ("--export", "--traces", "8", "--layers", "6", "--databases", "2"),
        ("export-parquet of 2 stores:", "spans/s", "peak"),
    ),
    "report_speed.py --export --stages": Smoke(
        ("--export", "--stages", "--traces", "8", "--layers", "6"),
        ("stages over rowids", "2 readers", "attribute reading", "Parquet writer", "imports"),
    ),
    "report_speed.py --fleet": Smoke(
        ("--fleet", "--databases", "2", "--traces", "10"),
        ("2 databases x 10 traces, 10,000 spans", "fleet report:", "spans/s"),
    ),
    "report_speed.py --fleet --fleet-dir": Smoke(
        ("--fleet", "--fleet-dir", "{fleet}"),
        ("fleet report:", "spans/s", "peak"),
    ),
    "hold_replay.py": Smoke(
        ("--calls", "200", "--repeat", "1"),
        ("sampling off", "sampling on, Python", "µs/call", "vs off"),
    ),
    "stream_sampling_cost.py": Smoke(
        ("--inferences", "200", "--repeat", "1"),
        ("no hook", "rate 0", "rate 0.01, budget 0", "µs/inference"),
    ),
    "profiling_accuracy.py": Smoke(
        ("--models", "small_cnn", "--iterations", "3", "--warmup", "1"),
        ("small_cnn", "trace M ms", "goals: ratio"),
    ),
    "cache_roofs.py": Smoke(
        (
            "--rounds",
            "1",
            "--budget",
            "0.2",
            "--models",
            "small_cnn",
            "--batch-sizes",
            "1",
            "--iterations",
            "3",
        ),
        ("cache roofs", "DRAM", "A14 with and without cache roofs", "small_cnn  cache"),
    ),
    "gpu_profile.py": Smoke(
        ("--cases", "resnet50:1", "--iterations", "2", "--warmup", "1", "--no-ncu"),
        ("",),  # "no GPU" here; the table where CUDA is
    ),
    "gpu_kernel_overhead.py": Smoke(
        (
            "--device",
            "cpu",
            "--cases",
            "resnet50:1",
            "--iterations",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
        ),
        (
            "plain",
            "hooks",
            "resnet50:1",
            "150 modules",
            "ms by process",
        ),  # CUPTI's columns need a GPU
    ),
    "gpu_after_cupti.py": Smoke(
        (
            "--device",
            "cpu",
            "--cases",
            "resnet50:1",
            "--rounds",
            "1",
            "--iterations",
            "2",
            "--warmup",
            "1",
        ),
        ("resnet50:1", "control", "median after/before"),  # the CUPTI arms need a GPU
    ),
    "proxy_overhead.py --sampling-ab": Smoke(
        (
            "--sampling-ab",
            "--duration",
            "1",
            "--warmup",
            "0.3",
            "--rounds",
            "1",
            "--concurrency",
            "1",
            "--idle",
            "0.5",
        ),
        (
            "sampling off",
            "default",
            "slow p99",
            "p99, all held",
            "CPU us/req",
            "relay CPU by thread, ms/s",
            "relay CPU by thread, us/req",
            "xsp-profiling",  # a thread named under thread_names_shim.py
        ),
        triton=True,
        timeout=300.0,
    ),
    "proxy_overhead.py --streaming": Smoke(
        # the plain run (unary direct and relayed, perf_analyzer) and the streams beside it
        ("--streaming", "--duration", "1", "--warmup", "0.3", "--concurrency", "1"),
        (
            "Triton",
            "relay",
            "perf_analyzer",
            "ModelStreamInfer, one stream per client",
            "relay CPU per inference, stream / unary",
        ),
        triton=True,
        timeout=400.0,
    ),
    "proxy_overhead.py --sizes": Smoke(
        # 16 B and 2 MiB each way beside socat, and the split-frame cost at 2 MiB
        (
            "--sizes",
            "16",
            "2M",
            "--duration",
            "1",
            "--warmup",
            "0.3",
            "--rounds",
            "1",
            "--concurrency",
            "1",
            "--split-calls",
            "4",
        ),
        (
            "size 16 B each way, concurrency 1",
            "size 2097152 B each way, concurrency 1",
            "relay off",
            "relay on",
            "CPU us/call",
            "sampling on adds",
            "frames split across reads",
            "split-aligned",
        ),
        triton=True,
        timeout=400.0,
    ),
    "proxy_overhead.py --protocol http": Smoke(
        (
            "--protocol",
            "http",
            "--sizes",
            "16",
            "--duration",
            "1",
            "--warmup",
            "0.3",
            "--rounds",
            "1",
            "--concurrency",
            "1",
        ),
        ("HTTP through Triton", "size 16 B each way", "relay on", "sampling on adds"),
        triton=True,
        timeout=300.0,
    ),
    "arm_request.py": Smoke(
        ("--number", "1000", "--repeat", "2"),
        ("arm_request: best", "ns, median"),
    ),
    "python_models.py": Smoke(
        # offline only: the live and ensemble modes need Triton and tens of seconds
        ("--iterations", "3", "--warmup", "1"),
        ("offline, 3 timed runs per level", "L/M", "add_sub", "bls_cnn"),
    ),
    "relay_breakdown.py": Smoke(
        # four clients (the bench's default): with one or two, every recorded connection
        # sometimes replayed no whole call (seen on a quiet 2-core machine, not diagnosed)
        ("--duration", "4", "--warmup", "0.5", "--concurrency", "4"),
        ("relay process CPU", "us/call", "replayed hot"),
        triton=True,
        timeout=300.0,
    ),
    "relay_floor.py": Smoke(
        ("--duration", "1", "--rounds", "1", "--concurrency", "1"),
        ("observing off", "bare uvloop", "CPU us", "reads", "writes"),  # socat if installed
        triton=True,
        timeout=300.0,
    ),
    "sampling_impact.py": Smoke(
        (
            "--duration",
            "2",
            "--warmup",
            "0.3",
            "--concurrency",
            "1",
            "--rounds",
            "1",
            "--prime-wait",
            "1",
        ),
        ("sidecar off", "sample rate"),
        triton=True,
        timeout=300.0,
    ),
}
# Scripts run by another test, or only as a part of one above.
COVERED_ELSEWHERE = {
    "soak.py": "tests/bench/test_soak_short.py",
    "relay_shim.py": "relay_breakdown.py runs the relay under it",
    "thread_names_shim.py": "proxy_overhead.py --sampling-ab runs its relays under it",
    "perf_analyzer.py": "proxy_overhead.py runs it (a module, no command line)",
    "size_floor.py": "proxy_overhead.py --sizes / --protocol http run it (a module)",
}


def _params() -> list[object]:
    out = []
    for key, smoke in SMOKE.items():
        marks = [pytest.mark.triton, pytest.mark.slow] if smoke.triton else []
        out.append(pytest.param(key, smoke, marks=marks, id=key.replace(" ", "")))
    return out


def test_every_bench_script_has_a_smoke_run() -> None:
    scripts = {p.name for p in BENCH.glob("*.py")}
    smoked = {key.split()[0] for key in SMOKE}
    assert scripts - smoked - set(COVERED_ELSEWHERE) == set()
    assert smoked | set(COVERED_ELSEWHERE) <= scripts  # no entry for a removed script


@pytest.mark.parametrize(("key", "smoke"), _params())
def test_bench_runs_at_a_toy_size(key: str, smoke: Smoke, tmp_path: Path) -> None:
    script = BENCH / key.split()[0]
    if "{fleet}" in smoke.args:  # an existing export: a toy one, written by export-parquet
        fleet = tmp_path / "fleet"
        report = REPO / "analysis" / "report.py"
        db = REPO / "tests" / "data" / "gpu" / "traces.sqlite"
        subprocess.run([sys.executable, str(report), "export-parquet", str(db), "--out",
                        str(fleet)], check=True, capture_output=True, timeout=120)  # fmt: skip
        smoke = Smoke(tuple(a.replace("{fleet}", str(fleet)) for a in smoke.args), smoke.expect)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, str(script), *smoke.args],
        capture_output=True,
        text=True,
        timeout=smoke.timeout,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for text in smoke.expect:
        assert text in run.stdout, run.stdout[-4000:]
