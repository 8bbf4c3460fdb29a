"""The cache levels' roofs on this machine, and what they change in the layer roofline (A14).

1. The roofs (`sidecar.profiling.cache_roofs`) measured `--rounds` times: per level its size,
   the best, median and worst round in GB/s, and the best as a ratio of DRAM's; the seconds
   one measurement takes (what the first profile on a machine pays once, before caching).
2. The small CNN and ResNet-50 (ONNX Runtime, CPU; every batch in `--batch-sizes`) profiled
   with this machine's peak, then A14 read twice from the same store: with the cache roofs the
   traces recorded, and without them (as traces recorded before them read): layers above the
   roof, how many of those say "re-measure the peak", and which level each layer was judged
   against.

    python bench/cache_roofs.py [--rounds 5] [--budget 0.6] [--batch-sizes 1,8]
        [--models small_cnn,resnet50] [--iterations 10]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

from analysis.analyses.roofline import peak_doubtful
from analysis.trace_analysis import TraceAnalysis
from sidecar.cli import main as sidecar_main
from sidecar.profiling.cache_roofs import measure_cache_roofs
from tests.harness import models

MODELS = {"small_cnn": models.small_cnn_onnx, "resnet50": models.resnet50_onnx}


def roofs_table(rounds: int, budget: float) -> None:
    runs, seconds = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        runs.append(measure_cache_roofs(budget_s=budget))
        seconds.append(time.perf_counter() - t0)
    sizes = runs[0].sizes_bytes
    dram = max(r.bytes_per_s["DRAM"] for r in runs)
    print(f"cache roofs, {rounds} rounds of {budget} s budget ({runs[0].source})")
    print(f"  {'level':<6}{'size':>12}{'best GB/s':>11}{'median':>9}{'worst':>9}{'/ DRAM':>8}")
    for level in [*sizes, "DRAM"]:
        bw = sorted(r.bytes_per_s[level] / 1e9 for r in runs)
        size = f"{sizes[level] / 2**10:.0f} KiB" if level in sizes else "-"
        print(
            f"  {level:<6}{size:>12}{bw[-1]:>11.1f}{statistics.median(bw):>9.1f}{bw[0]:>9.1f}"
            f"{bw[-1] * 1e9 / dram:>8.2f}"
        )
    print(f"  one measurement: {statistics.median(seconds):.2f} s (median of {rounds})")


def _without_cache_roofs(db: Path, out: Path) -> Path:
    shutil.copy(db, out)
    conn = sqlite3.connect(out)
    conn.execute(
        "UPDATE traces SET attributes = json_remove(attributes, '$.cache_sizes_bytes', "
        "'$.peak_cache_bytes_per_s', '$.peak_cache_source')"
    )
    conn.commit()
    conn.close()
    return out


def _a14_row(db: Path) -> str:
    """Layers, layers above the roof, those of them that say "re-measure the peak", the
    findings that say it, and the levels the layers were judged against."""
    ta = TraceAnalysis.from_paths([db])
    table = ta.result("A14").table
    above = int(table["above_roof"].sum())
    remeasure = int(peak_doubtful(table).sum())
    finding = sum(f.rule == "peak_below_achieved" for f in ta.findings())
    levels = "-"
    if "memory_roof" in table.columns:
        counts = table["memory_roof"].value_counts()
        levels = ", ".join(f"{counts[k]} {k}" for k in sorted(counts.index))
    return f"{len(table):>7}{above:>7}{remeasure:>11}{finding:>9}  {levels}"


def a14_side_by_side(names: list[str], batches: str, iterations: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        print(f"\nA14 with and without cache roofs (ONNX Runtime, CPU, batch {batches})")
        print(f"  {'model':<11}{'roofs':<9}{'layers':>7}{'above':>7}{'re-measure':>11}"
              f"{'finding':>9}  levels")  # fmt: skip
        for name in names:
            model = models.save_onnx(MODELS[name](), base / f"{name}.onnx")
            db = base / f"{name}.db"
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                rc = sidecar_main(["profile", str(model), "--levels", "M,L", "--db", str(db),
                                   "--batch-size", batches, "--iterations", str(iterations),
                                   "--warmup", "2", "--max-rounds", "0"])  # fmt: skip
            if rc != 0:
                print(f"  {name}: profile failed (exit {rc})")
                continue
            old = _without_cache_roofs(db, base / f"{name}-old.db")
            for label, path in (("DRAM", old), ("cache", db)):
                print(f"  {name:<11}{label:<9}{_a14_row(path)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.6)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--models", default="small_cnn,resnet50")
    ap.add_argument("--iterations", type=int, default=10)
    args = ap.parse_args()
    roofs_table(args.rounds, args.budget)
    a14_side_by_side(args.models.split(","), args.batch_sizes, args.iterations)


if __name__ == "__main__":
    main()
