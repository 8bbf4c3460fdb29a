"""The measured constants of the report's loader and scheduler, in one place, each with the
bench that set it (`docs/benchmarks.md`, the section named) and what it measured.

The numbers are this project's 2-vCPU VM's at 486 k spans (`python bench/report_speed.py --db
STORE --format json`, STORE from `--traces 1000 --keep STORE`) unless a line says otherwise; a
change here is a change to measure the same way, alternated with main in the same minutes
(`--against MAIN_CHECKOUT --repeat N`).
Nothing here changes what a report says, only how fast and in how much memory (the goldens in
`tests/data/golden/` hold the output).
"""

from __future__ import annotations

# -- reading a store (`load/columnar.py`) -----------------------------------------------------

# Rows per Arrow record batch from ADBC's SQLite driver. "`export-parquet` at the speed of the
# data, fifth pass": the whole export at 2 M spans, 2,048 rows 3.69-3.87 s CPU and 0.19 GB,
# 16,384 3.82-3.93 s and 0.23 GB, 65,536 3.86-4.05 s and 0.34 GB: CPU the same within noise,
# memory grows past this.
BATCH_ROWS = 16_384
# The export reads a store's spans in parallel rowid ranges of at least this many rows, one
# reader per core; a store under this is one part (a part costs a reader's start). Set with
# the parallel export ("`export-parquet` at the speed of the data"), not swept on its own.
EXPORT_PART_ROWS = 200_000
# The report reads a store's spans in batches of this many rowids, two readers ahead of the
# loader. "The kernel and layer levels in DuckDB": 50 k instead of 100 k, load peak 0.30 instead
# of 0.33 GB at 486 k and 0.48 instead of 0.54 GB at 8 M, the same time.
REPORT_BATCH_ROWS = 50_000

# -- the loader (`load/tracedb.py`, `load/level_rows.py`) -------------------------------------

# The spans taken the pandas way (the few of other levels, the damaged rows) gathered into
# tables of at least this many rows. "The single-store report two queries at a time": each
# table costs about 17 ms whatever its size (ten a store before).
REST_ROWS = 50_000
# Hand freed pages back to the system (`load/heap.py`) after letting go of this many bytes.
# "Single-store report in batches, fourth pass": every 32 MB and after each analysis, load peak at
# 2.0 M spans 0.86 -> 0.58 GB for 0.14 s CPU; a trim per column and per batch cost 0.45 s.
TRIM_BYTES = 32 << 20

# -- the kernel and layer spans in DuckDB (`load/span_store.py`) ------------------------------

# DuckDB's memory for the spans and relations; past it, a temporary folder. "The kernel and
# layer levels in DuckDB": 64 MB ran out of memory in A11's per-trace sums at 8 M spans and
# took 27 s for the load alone; 128 MB, one thread: memory flat (0.37 -> 0.47 GB over 10x).
MEMORY_LIMIT = "128MB"
# DuckDB's threads. Same section: two threads at 128 MB ran out of memory in the relations'
# sorts and joins at 8 M spans; two at 256 MB took 41 s but 0.64 GB.
THREADS = 1
# What `SpanStore.add_arrow` inserts at once, per level: a DuckDB row group of kernels (their
# strings short, their numbers many); layers as they come. Same section: the inserts 0.17 s
# CPU at 486 k instead of 0.43 s batch by batch; layers held too: 0.58 GB load peak at 8 M.
INSERT_ROWS = {"kernel": 122_880, "layer": 1}

# -- the analyses' scheduling (`trace_analysis.py`, `relations/kernel_rows.py`) -----------------

# Analyses run at once, each on a connection of its own (`TraceAnalysis.prefetch`); one that
# runs out of DuckDB's memory beside another runs again alone. "The single-store report two
# queries at a time": after the load, prefetch + findings 0.80-0.87 s one at a time,
# 0.47-0.53 s two at a time.
PARALLEL_WORKERS = 2
# After the analyses that read no span SQL, the slowest first, so that the last to finish is a
# short one. Same section: A8, A9, A14, A2, A11 and time_breakdown take 0.06-0.15 s each at
# 486 k; in this order, 0.47 s for them all instead of 0.52 s.
SLOWEST = ("A8", "A9", "A14", "A2", "A11", "time_breakdown")
