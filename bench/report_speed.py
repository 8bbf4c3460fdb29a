"""How fast is `analysis/report.py` on a big trace store?

    python bench/report_speed.py [--traces 1000] [--layers 60] [--format text] [--keep DB]
    python bench/report_speed.py --db DB [--format json] [--repeat N] [--against CHECKOUT]
    python bench/report_speed.py --export [--databases 4] [--traces 1000] [--db DB]
    python bench/report_speed.py --fleet [--databases 100] [--traces 1000] [--keep DIR]

Generates N GPU-shaped traces of ~500 spans each (M, L and K runs of a 60-layer model with
synthetic CUPTI-like kernel records, from tests/harness/traces/report_scenarios.py) into a temporary
trace store, then times one full report (load + every analysis + rendering) as its own
process. Goal: 1,000 traces x 486 spans in 2 s or less, peaking at 0.5 GB or less. Prints the
time, spans/s and peak memory (the process's maximum resident set), and the machine's load
average around the run (on a shared machine other work stretches the wall time, not the CPU
time); `--repeat N` times the report N times, each its own process. `--against CHECKOUT`
also times CHECKOUT's report (main's worktree, say, run by this Python) each time, the two
alternated so that the machine's drift falls on both.

`--export`: `report.py export-parquet` of `--databases` (4) copies of such a store. Goal:
1 M spans/s (the spans in the stores / the wall time of the whole command as a process),
peaking at 0.5 GB or less. `--export --stages`: where an export's time goes, each stage alone
in this process over the store's first `--stage-rows` rowids (1,000,000): SQLite's scan with
the export's checks, ADBC's Arrow batches (the bare columns with one and two readers: the
floor; the export's query), DuckDB's attribute reading, the Parquet writer; and the command's
imports.

`--fleet`: a fleet of `--databases` pods' exports, generated directly as Parquet by DuckDB SQL
(`range()`, no Python loop over rows) in the layout of `report.py export-parquet`, every column
it writes: per trace one request span (the relay's marks; every seventh a stream message with its
responses), five backend spans, and M, L and K runs of a 60-layer model (3 model spans, 120
layer spans, 371 kernels: 500 spans); each trace's fidelity fields (most with a batch window,
some sampled as slow). Times the fleet report (`report.py fleet`, every analysis in DuckDB,
fidelity and stream responses included). Goal: 100 databases x 1,000 traces x 500 spans (50 M
spans) in under 2 minutes.

Every step is timed as a separate `report.py` process, so that its peak memory is its own.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def generate(path: Path, n_traces: int, n_layers: int) -> int:
    from sidecar.trace.store import PendingWrite, TraceStore
    from tests.harness.traces import report_scenarios as gen
    from tests.harness.traces.synthetic import BASE_NS, Ids

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
    ids = Ids(rng)
    store = TraceStore(path)
    n_spans = 0
    batch: list[PendingWrite] = []
    try:
        for n in range(n_traces):
            trace, spans, stats = gen.gpu_trace(
                ids,
                rng,
                (1, 2, 4, 8)[n % 4],
                BASE_NS + n * 10**9,
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
# issue 25's goals: one pod's store (486 k spans) reported in 2 s, exports at 1 M spans/s,
# both peaking at 0.5 GB or less
REPORT_GOAL_S = 2.0
EXPORT_GOAL_SPANS_S = 1_000_000
PEAK_GOAL_BYTES = 500_000_000
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
       CASE WHEN s > 8 THEN (d * 1000)::DOUBLE END AS flops,
       CASE WHEN s = 0 THEN d // 10 END AS relay_request_end_offset_ns,
       CASE WHEN s = 0 THEN d * 9 // 10 END AS relay_response_start_offset_ns,
       CASE WHEN s = 0 THEN t % 7 = 0 END AS stream_span,
       CASE WHEN s = 0 AND t % 7 = 0 THEN (2 + t % 5)::DOUBLE END AS responses,
       CASE WHEN s = 0 THEN CASE WHEN t % 7 = 0
            THEN list_transform(range(1 + t % 5), lambda k: (d // 20 * (k + 1))::DOUBLE)
            ELSE []::DOUBLE[] END END AS response_gaps_ns
FROM (
    SELECT t, s, (1000 + hash('{db}', t, s) % 100000)::BIGINT AS d
    FROM range({traces}) r(t), range({spans}) q(s)
)
"""
_FLEET_TRACES = """
SELECT '{db}' AS source_db, md5('{db}' || '-' || t) AS trace_id, 'model_' || (t % 5) AS model,
       '1' AS model_version, [1, 2, 4, 8][1 + t % 4]::BIGINT AS batch_size,
       'NVIDIA H100' AS device, 'onnxruntime' AS runtime, 'ok' AS status,
       {base} + t * 1000000000 AS created_ns,
       CASE WHEN t % 13 = 7 THEN 'slow' ELSE 'rate' END AS sample_reason,
       t % 10 <> 9 AS fidelity_kept,
       CASE WHEN t % 10 <> 9 THEN (300000 + hash('{db}', t) % 600000)::DOUBLE END
           AS live_compute_ns,
       CASE WHEN t % 10 <> 9 THEN 'compute_infer' END AS live_source,
       NULL::DOUBLE AS replay_model_ns, NULL::DOUBLE AS fidelity_ratio,
       CASE WHEN t % 10 = 9 THEN [] WHEN t % 8 = 3 THEN [1]
            ELSE [[1, 2, 4, 8][1 + t % 4]] END::INTEGER[] AS server_batch_sizes,
       CASE WHEN t % 10 <> 9 THEN 1.0 END::DOUBLE AS window_executions,
       NULL::VARCHAR AS window_note,
       CASE WHEN t % 8 = 3 THEN ['the server ran another batch size'] ELSE [] END::VARCHAR[]
           AS fidelity_causes
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


@dataclass(frozen=True)
class Measured:
    """One step run as its own process: wall and CPU seconds, peak resident memory."""

    wall_s: float
    cpu_s: float
    peak_bytes: int

    def line(self, what: str, n_spans: int) -> str:
        return (
            f"{what}: {self.wall_s:.2f} s wall ({self.cpu_s:.2f} s CPU), "
            f"{n_spans / self.wall_s:,.0f} spans/s, peak {self.peak_bytes / 1e9:.2f} GB"
        )


def measure(argv: list[str], repo: Path = REPO) -> Measured:
    """Run `report.py ARGV` of the checkout `repo` in a fresh process (so that its peak memory
    is its own, not the generator's) and measure it; raises with its stderr when it fails."""
    cmd = [sys.executable, str(repo / "analysis" / "report.py"), *argv]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        took = time.perf_counter() - t0
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(
                f"report.py {argv[0]} failed ({proc.returncode}): {err.read().decode()[-2000:]}"
            )
    return Measured(took, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024)


def fleet(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "fleet"
        if args.fleet_dir:
            out = args.fleet_dir
            import duckdb

            rows = duckdb.sql(f"SELECT count(*) FROM '{out}/spans/*.parquet'").fetchall()
            n_spans = int(rows[0][0])
        else:
            t0 = time.perf_counter()
            n_spans = generate_fleet(out, args.databases, args.traces, args.layers)
            print(
                f"generated {args.databases} databases x {args.traces} traces, {n_spans:,} "
                f"spans as Parquet in {time.perf_counter() - t0:.1f} s"
            )
        m = measure(["fleet", str(out), "--format", "json", "--out", str(Path(tmp) / "out")])
        verdict = "OK" if m.wall_s < FLEET_GOAL_S else f"SLOWER than the {FLEET_GOAL_S:.0f} s goal"
        print(f"{m.line('fleet report', n_spans)} [{verdict}]")
    return 0


def store(args: argparse.Namespace, tmp: Path) -> tuple[Path, int]:
    """The store to time: `--db`, or one generated (and `--keep`t)."""
    if args.db:
        return args.db, _count_spans(args.db)
    db: Path = args.keep or tmp / "bench.db"
    t0 = time.perf_counter()
    n_spans = generate(db, args.traces, args.layers)
    print(
        f"generated {args.traces} traces, {n_spans} spans "
        f"({n_spans / args.traces:.0f}/trace) in {time.perf_counter() - t0:.1f} s"
    )
    return db, n_spans


def export(args: argparse.Namespace) -> int:
    """`report.py export-parquet` of `--databases` copies of one store."""
    with tempfile.TemporaryDirectory() as tmp:
        db, n_spans = store(args, Path(tmp))
        pods = []
        for i in range(args.databases):
            pod = Path(tmp) / f"pod-{i}.db"
            shutil.copyfile(db, pod)
            pods.append(str(pod))
        n_spans *= args.databases
        m = measure(["export-parquet", *pods, "--out", str(Path(tmp) / "fleet")])
        goal = m.wall_s <= n_spans / EXPORT_GOAL_SPANS_S and m.peak_bytes <= PEAK_GOAL_BYTES
        verdict = "OK" if goal else "MISSES the 1 M spans/s, 0.5 GB goal"
        print(f"{m.line(f'export-parquet of {args.databases} stores', n_spans)} [{verdict}]")
    return 0


def _stage(what: str, run: Callable[[], object]) -> object:
    """Run one stage in this process and print its wall and CPU seconds."""

    def cpu() -> float:  # this process's and its children's (the imports' process)
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + child.ru_utime + child.ru_stime

    cpu0, t0 = cpu(), time.perf_counter()
    out = run()
    print(f"  {what}: {time.perf_counter() - t0:.2f} s wall, {cpu() - cpu0:.2f} s CPU")
    return out


def export_stages(args: argparse.Namespace) -> int:
    """`--export --stages`: the export's stages one by one (see the module's docstring)."""
    import pyarrow as pa

    from analysis.fleet import export as fleet_export
    from analysis.load import columnar

    with tempfile.TemporaryDirectory() as tmp:
        db, _ = store(args, Path(tmp))
        low, high = columnar._rowid_bounds(db)
        if low is None or high is None:
            print("no spans")
            return 0
        high = min(high, low + args.stage_rows - 1)
        where = f"s.rowid BETWEEN {low} AND {high}"
        cols = "s.trace_id, s.span_id, s.level, s.name, s.kind, s.run_level, s.start_ns, "
        bare = f"SELECT {cols}s.end_ns, s.duration_ns, s.idx, s.attributes FROM spans s"
        query = f"{columnar.SPANS_SQL} AND {where}"
        uri = columnar._uri(db, columnar._immutable(db))  # as the export opens it

        def arrow(sql: str) -> pa.Table:
            import adbc_driver_manager as adbc
            import adbc_driver_sqlite

            database = adbc_driver_sqlite.connect(uri)
            conn = adbc.AdbcConnection(database)
            stmt = adbc.AdbcStatement(conn)
            try:
                stmt.set_options(**{"adbc.sqlite.query.batch_rows": str(columnar.BATCH_ROWS)})
                stmt.set_sql_query(sql)
                stream, _ = stmt.execute_query()
                return pa.RecordBatchReader._import_from_c(stream.address).read_all()
            finally:
                stmt.close()
                conn.close()
                database.close()

        def readers(n: int) -> int:
            step = (high - low + n) // n
            parts = [f"{bare} WHERE s.rowid BETWEEN {low + k * step} AND "
                     f"{min(high, low + (k + 1) * step - 1)}" for k in range(n)]  # fmt: skip
            with ThreadPoolExecutor(n) as pool:
                return sum(t.num_rows for t in pool.map(arrow, parts))

        print(f"stages over rowids {low}..{high} of {db}:")
        _stage("SQLite's scan with the export's checks (count, no Arrow)",
               lambda: arrow(f"SELECT count(*) FROM ({query})"))  # fmt: skip
        _stage("ADBC, bare columns to Arrow, 1 reader", lambda: readers(1))
        _stage("ADBC, bare columns to Arrow, 2 readers", lambda: readers(2))
        table = _stage("ADBC, the export's query to Arrow", lambda: arrow(query))
        con = fleet_export.reader_duckdb()
        try:
            con.register("batches", table)
            select = columnar.select_sql("spans", str(db), "batches")
            spans = _stage("DuckDB, the export's attribute reading",
                           lambda: con.sql(select).to_arrow_table())  # fmt: skip
            con.execute("RESET disabled_optimizers")
            _stage("  the same with DuckDB's filter pushdown (before issue 25's fifth pass)",
                   lambda: con.sql(select).to_arrow_table())  # fmt: skip
            con.register("spans", spans)
            for codec in ("snappy", "zstd", "uncompressed"):
                target = Path(tmp) / f"{codec}.parquet"
                copy = (
                    f"COPY spans TO '{target}' (FORMAT parquet, COMPRESSION {codec}, "
                    f"ROW_GROUP_SIZE {fleet_export.ROW_GROUP_ROWS})"
                )
                _stage(f"DuckDB's Parquet writer ({codec})", lambda c=copy: con.execute(c))
                print(f"    {target.stat().st_size / 1e6:.1f} MB for {spans.num_rows:,} spans")
        finally:
            con.close()
        code = "import analysis.fleet.export"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        _stage("the command's imports (a new process)", lambda: subprocess.run(
            [sys.executable, "-c", code], check=True, env=env))  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--format", default="text", choices=["text", "json", "html", "csv"])
    parser.add_argument("--keep", type=Path, help="keep the generated store (--fleet: folder)")
    parser.add_argument("--db", type=Path, help="time a report on this existing store instead")
    parser.add_argument("--fleet", action="store_true", help="time the fleet report instead")
    parser.add_argument(
        "--export", action="store_true", help="time export-parquet of --databases copies"
    )
    parser.add_argument("--databases", type=int, default=None, help="--fleet/--export: pods")
    parser.add_argument("--fleet-dir", type=Path, help="--fleet: time this existing export")
    parser.add_argument("--stages", action="store_true", help="--export: time its stages")
    parser.add_argument("--stage-rows", type=int, default=1_000_000, help="--stages: rowids")
    parser.add_argument(
        "--repeat", type=int, default=1, help="single store: time the report this many times"
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="single store: each time, also time the report of this other checkout (main's), "
        "the two alternated (ABBA...) so that the machine's drift falls on both",
    )
    args = parser.parse_args()
    if args.databases is None:
        args.databases = 4 if args.export else 100
    if args.fleet:
        return fleet(args)
    if args.export and args.stages:
        return export_stages(args)
    if args.export:
        return export(args)
    with tempfile.TemporaryDirectory() as tmp:
        db, n_spans = store(args, Path(tmp))
        trees = [("this tree", REPO)] + (
            [(str(args.against), args.against)] if args.against else []
        )
        for i in range(args.repeat):
            for name, repo in trees if i % 2 == 0 else trees[::-1]:
                before = os.getloadavg()[0]  # (a shared machine: other work stretches the wall)
                argv = [str(db), "--format", args.format, "--out", str(Path(tmp) / "out")]
                m = measure(argv, repo)
                goal = m.wall_s <= REPORT_GOAL_S and m.peak_bytes <= PEAK_GOAL_BYTES
                verdict = "OK" if goal else "MISSES the 2 s, 0.5 GB goal at 486 k spans"
                load = f"load average {before:.2f} -> {os.getloadavg()[0]:.2f}"
                what = f"full report ({args.format})" + (f", {name}" if args.against else "")
                print(f"{m.line(what, n_spans)}, {load} [{verdict}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
