"""How fast is `analysis/report.py` on a big trace store?

    python bench/report_speed.py [--traces 1000] [--layers 60] [--format text] [--keep DB]

Generates N GPU-shaped traces of ~500 spans each (M, L and K runs of a 60-layer model with
synthetic CUPTI-like kernel records, from scripts/make_report_testdata.py) into a temporary
trace store, then times one full report (load + every analysis + rendering) in-process.
Goal: 1,000 traces x ~500 spans in under 10 s. Prints the time and spans/s.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _testdata() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_report_testdata", REPO / "scripts" / "make_report_testdata.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def generate(path: Path, n_traces: int, n_layers: int) -> int:
    from sidecar.trace.store import PendingWrite, TraceStore

    gen = _testdata()
    layers = tuple(
        gen.LayerSpec(
            f"{spec.name}_{i}",
            spec.op_type,
            spec.out_shape,
            spec.base_us,
            spec.flops,
            spec.dram_bytes,
            spec.allocated_bytes,
        )
        for i in range(n_layers // len(gen.GPU_LAYERS) + 1)
        for spec in gen.GPU_LAYERS
    )[:n_layers]
    rng = random.Random(7)
    ids = gen.Ids(rng)
    store = TraceStore(path)
    n_spans = 0
    batch: list[PendingWrite] = []
    try:
        for n in range(n_traces):
            trace, spans, stats = gen.gpu_trace(
                ids,
                rng,
                (1, 2, 4, 8)[n % 4],
                gen.BASE_NS + n * 10**9,
                layers=layers,
                kernels_per_layer=3,
            )
            trace.model = f"model_{n % 5}"
            n_spans += len(spans)
            batch.append(PendingWrite(trace.trace_id, trace, spans, stats))
            if len(batch) == 50:
                store.write_batch(batch)
                batch = []
        if batch:
            store.write_batch(batch)
    finally:
        store.close()
    return n_spans


def _count_spans(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM spans").fetchone()[0])
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--format", default="text", choices=["text", "json", "html", "csv"])
    parser.add_argument("--keep", type=Path, help="keep the generated store at this path")
    parser.add_argument("--db", type=Path, help="time a report on this existing store instead")
    args = parser.parse_args()
    from analysis import report

    with tempfile.TemporaryDirectory() as tmp:
        if args.db:
            db = args.db
            n_spans = _count_spans(db)
        else:
            db = args.keep or Path(tmp) / "bench.db"
            t0 = time.perf_counter()
            n_spans = generate(db, args.traces, args.layers)
            gen_s = time.perf_counter() - t0
            print(
                f"generated {args.traces} traces, {n_spans} spans "
                f"({n_spans / args.traces:.0f}/trace) in {gen_s:.1f} s"
            )
        out = Path(tmp) / "out"
        t0, c0 = time.perf_counter(), time.process_time()
        with contextlib.redirect_stderr(io.StringIO()):
            rc = report.main([str(db), "--format", args.format, "--out", str(out)])
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        if rc != 0:
            print(f"report failed with exit status {rc}", file=sys.stderr)
            return rc
        verdict = "OK" if took < 10 else "SLOWER than the 10 s goal"
        print(
            f"full report ({args.format}): {took:.2f} s wall ({cpu:.2f} s CPU), "
            f"{n_spans / took:,.0f} spans/s [{verdict}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
