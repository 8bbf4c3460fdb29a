"""Regenerate the small trace databases under tests/data/ that the analysis tests read.

    python scripts/make_report_testdata.py [--out tests/data]

Four scenarios, each a trace store written with `sidecar.trace.store.TraceStore` from the
`Trace` / `Span` / `LevelStats` records of `sidecar.trace.spans`:

- `cpu/traces.sqlite`: REAL profiles made by `xsp-sidecar profile` of the project's small CNN
  (tests.harness.models.small_cnn_onnx) on ONNX Runtime CPU at batch sizes 1, 2, 4,
  run 5 times (so 5 traces per batch size for the trimmed means), 10 iterations each. M and
  L runs; the kernel level is not captured on CPU (trace attribute `kernel_level` says why);
  layer FLOPs/bytes are estimates. Timings are this machine's, so they change on each run.
- `gpu/traces.sqlite`: a GPU-shaped trace built from SYNTHETIC CUPTI-like activity records
  (kernel / memcpy / memset activities with correlation ids, cudaLaunchKernel runtime
  records, flops, DRAM bytes, achieved occupancy) at batch sizes 1, 2, 4, 8. No GPU ran;
  every trace says so in its `synthetic` attribute.
- `live/traces.sqlite`: sampled live requests of two models: the proxy's request span, the
  backend's server spans (request, queue, compute, compute_input/infer/output) and the M/L
  replay of the same inputs. SYNTHETIC timings.
- `ensemble/traces.sqlite`: REAL replays of the sample ensemble `ens_cnn` (its Python step
  `pre`, then the ONNX `simple_cnn`: tests.harness.triton.ensemble_models) by the ensemble
  runner and the leveled experiment, as the sidecar replays a sampled request: M and L runs at
  batch sizes 1 and 2, 3 traces each, 10 iterations. Timings are this machine's.
  `--only ensemble` writes this store alone.

The synthetic records are built by `tests.harness.traces.report_scenarios`, with the ids and
conventions of `tests.harness.traces.synthetic` (what the trace store's tests build traces with).
Generation is deterministic (fixed seeds), so the files only change when those modules do.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

from tests.harness.traces.report_scenarios import cpu_records, gpu_records, live_records
from tests.harness.traces.synthetic import TraceParts


def write_db(path: Path, records: list[TraceParts]) -> None:
    """Write with the project's TraceStore, then leave a single rollback-journal file."""
    from sidecar.trace.store import TraceStore

    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    store = TraceStore(path)
    try:
        for trace, spans, stats in records:
            store.write_trace(trace, spans, stats)
    finally:
        store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.execute("VACUUM")
    conn.close()


def profile_cpu_db(path: Path, runs: int = 5) -> None:
    """Profile the small CNN with the real `xsp-sidecar profile` into `path`."""
    import subprocess
    import sys
    import tempfile

    from tests.harness import models

    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = models.save_onnx(models.small_cnn_onnx(), Path(tmp) / "small_cnn.onnx")
        for _ in range(runs):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "sidecar",
                    "profile",
                    str(model),
                    "--batch-size",
                    "1,2,4",
                    "--iterations",
                    "10",
                    "--warmup",
                    "3",
                    "--db",
                    str(path),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.execute("VACUUM")
    conn.close()


def profile_ensemble_db(path: Path, runs: int = 3) -> None:
    """Replay the sample ensemble with the real ensemble runner into `path`."""
    import tempfile

    import numpy as np

    from sidecar.backends.model_repository import find_model
    from sidecar.profiling.experiment import run_experiment
    from sidecar.profiling.runners.select import runner_for
    from sidecar.trace.spans import Level
    from tests.harness.triton.ensemble_models import ENSEMBLE, add_ensemble
    from tests.harness.triton.model_repo import build_model_repository

    records: list[TraceParts] = []
    rng = np.random.default_rng(4)
    with tempfile.TemporaryDirectory() as tmp:
        location = find_model(add_ensemble(build_model_repository(Path(tmp) / "models")), ENSEMBLE)
        for batch in (1, 2):
            raw = rng.uniform(0, 255, (batch, 3, 32, 32)).astype(np.float32)
            for _ in range(runs):
                runner = runner_for(location.path, location.format, find=find_model)
                profile = run_experiment(
                    runner, {"RAW": raw}, model=ENSEMBLE, levels=(Level.MODEL, Level.LAYER),
                    iterations=10, warmup=3, batch_size=batch,
                )  # fmt: skip
                records.append((profile.trace, profile.spans, profile.level_stats))
    write_db(path, records)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "tests/data")
    parser.add_argument(
        "--synthetic-cpu",
        action="store_true",
        help="write a synthetic CPU store instead of profiling the small CNN for real",
    )
    parser.add_argument("--only", choices=["ensemble"], help="write this store alone")
    args = parser.parse_args()
    path = args.out / "ensemble" / "traces.sqlite"
    profile_ensemble_db(path)
    print(f"{path}: {path.stat().st_size} bytes")
    if args.only:
        return 0
    path = args.out / "cpu" / "traces.sqlite"
    if args.synthetic_cpu:
        write_db(path, cpu_records())
    else:
        profile_cpu_db(path)
    print(f"{path}: {path.stat().st_size} bytes")
    for name, records in (("gpu", gpu_records()), ("live", live_records())):
        path = args.out / name / "traces.sqlite"
        write_db(path, records)
        n_spans = sum(len(s) for _, s, _ in records)
        print(f"{path}: {len(records)} traces, {n_spans} spans, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
