"""How fast is `analysis/report.py` on a big trace store?

    python bench/report_speed.py [--traces 1000] [--layers 60] [--format text] [--keep DB]
    python bench/report_speed.py --fleet [--databases 100] [--traces 1000] [--keep DIR]

Generates N GPU-shaped traces of ~500 spans each (M, L and K runs of a 60-layer model with
synthetic CUPTI-like kernel records, from scripts/make_report_testdata.py) into a temporary
trace store, then times one full report (load + every analysis + rendering) in-process.
Goal: 1,000 traces x ~500 spans in under 10 s. Prints the time and spans/s.

`--fleet`: a fleet of `--databases` pods' exports, generated directly as Parquet by DuckDB SQL
(`range()`, no Python loop over rows) in the layout of `report.py export-parquet`: per trace one
request span, five backend spans, and M, L and K runs of a 60-layer model (3 model spans, 120
layer spans, 371 kernels: 500 spans). Times the fleet report (`report.py fleet`, every analysis
in DuckDB). Goal: 100 databases x 1,000 traces x 500 spans (50 M spans) in under 2 minutes.
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


FLEET_GOAL_S = 120.0
SPANS_PER_TRACE = 500
_SERVER_KINDS = ("request", "queue", "compute_input", "compute_infer", "compute_output")
_LAYER_TYPES = ("Conv", "Relu", "BatchNormalization", "Add", "MaxPool", "Gemm")

# One pod's spans: trace t (0..n-1) x slot s (0..499). Durations are deterministic hashes.
_FLEET_SPANS = """
SELECT '{db}' AS source_db, md5('{db}' || '-' || t) AS trace_id,
       format('{{:016x}}', hash('{db}', t, s)) AS span_id,
       CASE WHEN s = 0 THEN 'request' WHEN s <= 5 THEN 'server' WHEN s <= 8 THEN 'model'
            WHEN s <= 128 THEN 'layer' ELSE 'kernel' END AS level,
       CASE WHEN s = 0 THEN 'ModelInfer' WHEN s <= 5 THEN {server}[s]
            WHEN s <= 8 THEN 'model_' || (t % 5)
            WHEN s <= 128 THEN 'layer_' || ((s - 9) % {layers})
            ELSE 'kernel_' || (s % 37) END AS name,
       CASE WHEN s = 0 THEN 'ModelInfer' WHEN s <= 5 THEN {server}[s]
            WHEN s <= 8 THEN 'model' WHEN s <= 128 THEN {types}[1 + (s - 9) % {layers} % 6]
            ELSE 'kernel' END AS kind,
       CASE WHEN s <= 5 THEN NULL WHEN s <= 8 THEN ['model', 'layer', 'kernel'][s - 5]
            WHEN s <= 68 THEN 'layer' ELSE 'kernel' END AS run_level,
       {base} + t * 1000000000 + s * 1000 AS start_ns,
       {base} + t * 1000000000 + s * 1000 + d AS end_ns,
       d AS duration_ns,
       CASE WHEN s BETWEEN 9 AND 128 THEN (s - 9) % {layers} ELSE s END AS idx,
       CASE WHEN s BETWEEN 9 AND 128 THEN {types}[1 + (s - 9) % {layers} % 6] END
           AS layer_type,
       CASE WHEN s > 8 THEN (d * 1000)::DOUBLE END AS flops
FROM (
    SELECT t, s, (1000 + hash('{db}', t, s) % 100000)::BIGINT AS d
    FROM range({traces}) r(t), range({spans}) q(s)
)
"""
_FLEET_TRACES = """
SELECT '{db}' AS source_db, md5('{db}' || '-' || t) AS trace_id, 'model_' || (t % 5) AS model,
       '1' AS model_version, [1, 2, 4, 8][1 + t % 4]::BIGINT AS batch_size,
       'NVIDIA H100' AS device, 'onnxruntime' AS runtime, 'ok' AS status,
       {base} + t * 1000000000 AS created_ns
FROM range({traces}) r(t)
"""
_FLEET_STATS = """
SELECT '{db}' AS source_db, md5('{db}' || '-' || t) AS trace_id, level,
       (100000 + hash('{db}', t, level) % 1000000)::BIGINT AS trimmed_mean_ns,
       1.0 + (hash('{db}', t, level) % 100) / 100.0 AS overhead_ratio
FROM range({traces}) r(t), (VALUES ('model'), ('layer'), ('kernel')) v(level)
"""


def generate_fleet(out: Path, n_dbs: int, n_traces: int, n_layers: int) -> int:
    """Write a fleet's export as Parquet with DuckDB SQL; returns the number of spans."""
    import duckdb

    from tests.harness.traces.synthetic import BASE_NS

    sql = {
        "spans": _FLEET_SPANS,
        "traces": _FLEET_TRACES,
        "level_stats": _FLEET_STATS,
    }
    fmt = {
        "traces": n_traces,
        "spans": SPANS_PER_TRACE,
        "layers": n_layers,
        "base": BASE_NS,
        "server": "[" + ", ".join(f"'{k}'" for k in _SERVER_KINDS) + "]",
        "types": "[" + ", ".join(f"'{k}'" for k in _LAYER_TYPES) + "]",
    }
    con = duckdb.connect()
    try:
        for table in sql:
            (out / table).mkdir(parents=True, exist_ok=True)
        for i in range(n_dbs):
            for table, query in sql.items():
                target = out / table / f"{i:04d}-pod-{i}.parquet"
                select = query.format(db=f"pods/pod-{i}/traces.db", **fmt)
                con.execute(f"COPY ({select}) TO '{target}' (FORMAT parquet)")
        return int(con.execute(f"SELECT count(*) FROM '{out}/spans/*.parquet'").fetchone()[0])
    finally:
        con.close()


def fleet(args: argparse.Namespace) -> int:
    from analysis import fleet as fleet_report

    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "fleet"
        if args.fleet_dir:
            out = args.fleet_dir
            import duckdb

            n_spans = int(
                duckdb.sql(f"SELECT count(*) FROM '{out}/spans/*.parquet'").fetchone()[0]  # type: ignore[index]
            )
        else:
            t0 = time.perf_counter()
            n_spans = generate_fleet(out, args.databases, args.traces, args.layers)
            print(
                f"generated {args.databases} databases x {args.traces} traces, {n_spans:,} "
                f"spans as Parquet in {time.perf_counter() - t0:.1f} s"
            )
        t0, c0 = time.perf_counter(), time.process_time()
        tables = fleet_report.fleet_tables(out, top=10)
        fleet_report.render_text(tables)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        verdict = "OK" if took < FLEET_GOAL_S else f"SLOWER than the {FLEET_GOAL_S:.0f} s goal"
        print(
            f"fleet report: {took:.1f} s wall ({cpu:.1f} s CPU), {n_spans / took:,.0f} spans/s, "
            f"{len(tables['traces'])} models [{verdict}]"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--format", default="text", choices=["text", "json", "html", "csv"])
    parser.add_argument("--keep", type=Path, help="keep the generated store (--fleet: folder)")
    parser.add_argument("--db", type=Path, help="time a report on this existing store instead")
    parser.add_argument("--fleet", action="store_true", help="time the fleet report instead")
    parser.add_argument("--databases", type=int, default=100, help="--fleet: pods")
    parser.add_argument("--fleet-dir", type=Path, help="--fleet: time this existing export")
    args = parser.parse_args()
    if args.fleet:
        return fleet(args)
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
