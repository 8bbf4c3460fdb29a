"""A fleet's traces as Parquet, and the fleet-level analyses over them in DuckDB SQL.

One SQLite store per pod is right for a pod; a fleet of hundreds is analysed columnar:
`export_parquet` (`analysis.fleet.export`) writes each store's rows as Parquet under
`DIR/{traces,spans,level_stats}/`, each trace with its fidelity fields (`FIDELITY_COLUMNS`),
each stream message's request span with its responses (`STREAM_COLUMNS`). `fleet_tables` runs
the per-model analyses over `DIR` with DuckDB in process: traces per model, model latency per
batch size, layer type shares, top layers by time, the live request breakdown, the replay's
fidelity and the streamed responses. The numbers follow the single-store report's rules
(trimmed means over traces cutting `TRIM` at each end, the L run's layer spans where there is
one, pandas' linear quantiles), which `tests/analysis/test_fleet.py` checks against it.
"""

from __future__ import annotations

import math
from pathlib import Path

import duckdb
import pandas as pd

from analysis.analyses import ensemble_steps, fidelity, stream_responses
from analysis.analyses.live import (
    BACKEND_PHASES,
    OVERLAP_TOLERANCE,
    PERCENTILES,
    PHASES,
    PLACEMENT_TOLERANCE_NS,
    REQUEST_END,
    RESPONSE_START,
    STEP_ORDER,
    STEPS_NOTE,
    TF_OP_KIND,
    with_step_rows,
)
from analysis.fleet.export import (  # noqa: F401  (the export, as `fleet` names it)
    FIDELITY_COLUMNS,
    ROW_GROUP_ROWS,
    STREAM_COLUMNS,
    TABLES,
    ExportCounts,
    export_parquet,
    fidelity_fields,
    quote,
)
from analysis.load import columnar
from analysis.load.store_file import RELAY_OFFSET_COLUMNS
from analysis.load.trace_filter import LOADED_SQL
from sidecar.profiling.stats import TRIM
from sidecar.trace.schema import COMPUTE_INFER, Level

TRACE_COLUMNS = columnar.TRACE_COLUMNS
SPAN_COLUMNS = columnar.SPAN_COLUMNS
STATS_COLUMNS = columnar.STATS_COLUMNS
FLEET_ANALYSES = (
    "traces",
    "model_latency",
    "layer_types",
    "top_layers",
    "live_breakdown",
    "fidelity",
    "stream_responses",
)


def connect(fleet_dir: Path, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with views `traces`, `spans`, `level_stats` over the Parquet files
    of `fleet_dir`, the traces restricted to profiles that succeeded and live-only traces (of
    a model no replay can run)."""
    con = duckdb.connect()
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    for table in TABLES:
        files = sorted((fleet_dir / table).glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{fleet_dir / table}: no Parquet files (export first)")
        where = f" WHERE {LOADED_SQL}" if table == "traces" else ""
        # union_by_name: a folder may hold exports of older sidecars, whose spans lack the
        # relay's marks; those columns then read as NULL (the breakdown's fallback)
        con.execute(
            f"CREATE VIEW {table}_raw AS SELECT * FROM read_parquet("
            f"'{quote(fleet_dir / table)}/*.parquet', union_by_name = true)"
        )
        have = {row[0] for row in con.execute(f"DESCRIBE {table}_raw").fetchall()}
        # and exports before the fidelity and stream columns: NULL there (the analyses say so)
        wanted = {"spans": {**dict.fromkeys(RELAY_OFFSET_COLUMNS.values(), "BIGINT"),
                            **STREAM_COLUMNS},
                  "traces": {"sample_reason": "VARCHAR", **FIDELITY_COLUMNS}}  # fmt: skip
        missing = {c: t for c, t in wanted.get(table, {}).items() if c not in have}
        extra = "".join(f", NULL::{t} AS {c}" for c, t in missing.items())
        con.execute(f"CREATE VIEW {table}_all AS SELECT *{extra} FROM {table}_raw{where}")
    con.execute("CREATE VIEW traces AS SELECT * FROM traces_all")
    for table in ("spans", "level_stats"):  # only rows of the selected traces
        con.execute(
            f"CREATE VIEW {table} AS SELECT x.* FROM {table}_all x "
            "SEMI JOIN traces t USING (source_db, trace_id)"
        )
    return con


def _trimmed(value: str, partition: str) -> str:
    """SQL over a subquery: keep rows whose rank within `partition` (by `value`) survives the
    trim of `TRIM` at each end (the rule of `sidecar.profiling.stats.trimmed_mean`)."""
    return (
        f"row_number() OVER (PARTITION BY {partition} ORDER BY {value}) - 1 AS _rank, "
        f"count(*) OVER (PARTITION BY {partition}) AS _n"
    )


_KEEP = f"_rank >= floor({TRIM} * _n) AND _rank < _n - floor({TRIM} * _n)"

# The replay's model latency per trace (`common.Frames.model_latency`): the M run's trimmed
# mean where the trace has one, else its first model span (the M run's first).
_PER_TRACE_LATENCY = f"""
from_stats AS (
    SELECT source_db, trace_id, trimmed_mean_ns::DOUBLE AS latency_ns
    FROM level_stats WHERE level = '{Level.MODEL}'
), from_spans AS (
    SELECT source_db, trace_id, arg_min(duration_ns, (run_level IS DISTINCT FROM '{Level.MODEL}',
           start_ns))::DOUBLE AS latency_ns
    FROM spans WHERE level = '{Level.MODEL}' GROUP BY source_db, trace_id
), per_trace AS (
    SELECT * FROM from_stats
    UNION ALL
    SELECT * FROM from_spans s ANTI JOIN from_stats f USING (source_db, trace_id)
)
"""

_MODEL_LATENCY = f"""
WITH {_PER_TRACE_LATENCY}, ranked AS (
    SELECT t.model, t.batch_size, p.latency_ns,
           {_trimmed("p.latency_ns", "t.model, t.batch_size")}
    FROM per_trace p JOIN traces t USING (source_db, trace_id)
)
SELECT model, batch_size, avg(latency_ns) FILTER (WHERE {_KEEP}) / 1e6 AS latency_ms,
       count(*) AS n_traces
FROM ranked GROUP BY model, batch_size ORDER BY model, batch_size
"""

# Layer spans as the report takes them (`kernel_rows`, relation `layers`): one run per trace, the L
# run's where it has one, and every call its own row: the n-th repeat of a name in the run is
# `name#n` (CPU traces store each call under the module's name).
_LAYERS = f"""
layer_spans AS (
    SELECT s.*, arg_min(run_level, (run_level <> '{Level.LAYER}', run_level))
                    OVER (PARTITION BY source_db, trace_id) AS run
    FROM spans s WHERE level = '{Level.LAYER}'
), calls AS (
    SELECT *, row_number() OVER (PARTITION BY source_db, trace_id, run_level, name
                                 ORDER BY start_ns, idx) - 1 AS repeat
    FROM layer_spans WHERE run_level IS NOT DISTINCT FROM run
), layers AS (
    SELECT source_db, trace_id,
           CASE WHEN repeat > 0 THEN name || '#' || repeat ELSE name END AS name,
           duration_ns::DOUBLE AS duration_ns, layer_type AS type, idx
    FROM calls
), ranked AS (
    SELECT t.model, t.batch_size, l.name, l.type, l.idx, l.duration_ns,
           {{trimmed}}
    FROM layers l JOIN traces t USING (source_db, trace_id)
), per_layer AS (
    SELECT model, batch_size, name, arg_min(type, _rank) AS type,
           avg(duration_ns) FILTER (WHERE {{keep}}) AS duration_ns,
           count(*) AS n_traces
    FROM ranked GROUP BY model, batch_size, name
)
""".format(trimmed=_trimmed("l.duration_ns", "t.model, t.batch_size, l.name"), keep=_KEEP)

_LAYER_TYPES = f"""
WITH {_LAYERS}
SELECT model, batch_size, type, count(*) AS layers, sum(duration_ns) / 1e6 AS latency_ms,
       sum(duration_ns) / sum(sum(duration_ns)) OVER (PARTITION BY model, batch_size) AS share
FROM per_layer GROUP BY model, batch_size, type
ORDER BY model, batch_size, latency_ms DESC, type
"""

_TOP_LAYERS = f"""
WITH {_LAYERS}, shares AS (
    SELECT *, duration_ns / sum(duration_ns) OVER (PARTITION BY model, batch_size) AS share,
           row_number() OVER (PARTITION BY model, batch_size
                              ORDER BY duration_ns DESC, name) AS rank
    FROM per_layer
)
SELECT model, batch_size, rank, name, type, duration_ns / 1e6 AS latency_ms,
       share AS latency_share, n_traces
FROM shares WHERE rank <= $top ORDER BY model, batch_size, rank
"""

_PHASE_SUMS = ", ".join(
    f"sum(placed) FILTER (WHERE kind = '{k}') AS {k}" for k in ("request", *BACKEND_PHASES)
)
_PHASE_ANY = " OR ".join(f"{p} IS NOT NULL" for p in BACKEND_PHASES)
_PHASE_TOTAL = " + ".join(f"coalesce({p}, 0)" for p in BACKEND_PHASES)
_TOL = PLACEMENT_TOLERANCE_NS
_MEASURED = ensemble_steps.STEP_PHASES[:-1]
_STEP_PHASE_SUMS = ", ".join(
    f"CAST(sum(p.end_ns - p.start_ns) FILTER (WHERE p.kind = '{k}') AS DOUBLE) AS {k}"
    for k in _MEASURED
)
_STEP_TOL = ensemble_steps.TOLERANCE_NS
_MEASURED_COLUMNS = ", ".join(f"r.{k}" for k in _MEASURED)
# The rules of analysis.analyses.ensemble_steps: a trace's outermost server model span (the
# earliest, the longest first) is an ensemble's where others lie inside it, its steps (numbered in
# order of start); a step's phases are the phase spans inside its span; per trace, the gaps
# between steps, the ensemble's own time and the steps' overlap.
_STEPS = f"""
models AS (
    SELECT source_db, trace_id, name, start_ns, end_ns,
           row_number() OVER (PARTITION BY source_db, trace_id
                              ORDER BY start_ns, end_ns DESC) AS rn
    FROM spans WHERE level = '{Level.SERVER}' AND kind = 'model'
), steps AS (
    SELECT m.source_db, m.trace_id, o.name AS ensemble, m.name AS step, m.start_ns, m.end_ns,
           o.start_ns AS ens_start, o.end_ns AS ens_end,
           row_number() OVER (PARTITION BY m.source_db, m.trace_id
                              ORDER BY m.start_ns, m.end_ns DESC) AS idx
    FROM models m JOIN models o
      ON o.source_db = m.source_db AND o.trace_id = m.trace_id AND o.rn = 1
    WHERE m.rn > 1 AND m.start_ns >= o.start_ns AND m.end_ns <= o.end_ns
), step_rows AS (
    SELECT st.source_db, st.trace_id, st.ensemble, st.step, st.idx, st.start_ns, st.end_ns,
           {_STEP_PHASE_SUMS}
    FROM steps st LEFT JOIN spans p
      ON p.source_db = st.source_db AND p.trace_id = st.trace_id AND p.level = '{Level.SERVER}'
     AND p.kind IN ({", ".join(f"'{k}'" for k in _MEASURED)})
     AND p.start_ns >= st.start_ns - {_STEP_TOL} AND p.end_ns <= st.end_ns + {_STEP_TOL}
    GROUP BY ALL
), reach AS (  -- the latest end of the steps before each one (its own start for the first)
    SELECT *, coalesce(max(end_ns) OVER (PARTITION BY source_db, trace_id ORDER BY idx
                                         ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING),
                       start_ns) AS reach
    FROM steps
), gaps AS (
    SELECT source_db, trace_id, any_value(ensemble) AS ensemble,
           CAST(sum(greatest(start_ns - reach, 0)) AS DOUBLE) AS between_steps,
           CAST(greatest(min(start_ns) - any_value(ens_start), 0)
                + greatest(any_value(ens_end) - max(end_ns), 0) AS DOUBLE) AS ensemble_overhead,
           CAST(sum(greatest(least(reach, end_ns) - start_ns, 0)) AS DOUBLE) AS steps_overlap
    FROM reach GROUP BY source_db, trace_id
)"""
# The rules of analysis.analyses.live.request_phases: backend spans placed in the request's window
# at the relay (cut at the response's first byte, else at its end), traces whose spans cannot be
# placed left out (an ensemble's steps may overlap by their own stamps).
_PLACED = f"""
WITH {_STEPS}, requests AS (
    SELECT source_db, trace_id, arg_min(duration_ns, start_ns)::DOUBLE AS client_total,
           min(start_ns) AS t0,
           arg_min({REQUEST_END}, start_ns)::DOUBLE AS request_end,
           arg_min({RESPONSE_START}, start_ns)::DOUBLE AS response_start
    FROM spans WHERE level = '{Level.REQUEST}' GROUP BY source_db, trace_id
), win AS (
    SELECT *, coalesce(response_start, client_total) AS cut,
           response_start - request_end AS backend_response
    FROM requests
), placed AS (
    SELECT s.source_db, s.trace_id, s.kind, a, b,
           greatest(least(b, w.cut) - greatest(a, 0), 0) AS placed
    FROM (SELECT *, (start_ns - w0.t0)::DOUBLE AS a, (end_ns - w0.t0)::DOUBLE AS b
          FROM spans JOIN win w0 USING (source_db, trace_id) WHERE level = '{Level.SERVER}') s
    JOIN win w USING (source_db, trace_id)
), server AS (
    SELECT source_db, trace_id, {_PHASE_SUMS},
           min(a) FILTER (WHERE kind <> '{TF_OP_KIND}') AS first_start,
           min(a) FILTER (WHERE kind = '{TF_OP_KIND}') AS op_start,
           max(b) FILTER (WHERE kind = '{TF_OP_KIND}') AS op_end,
           max(b) AS last_end
    FROM placed GROUP BY source_db, trace_id
), raw AS (
    SELECT t.model, w.source_db AS _db, w.trace_id AS _tid,
           coalesce(g.steps_overlap, 0) AS _overlap, w.client_total, w.backend_response, w.cut,
           s.*,
           w.client_total - s.request AS network_proxy,
           s.request - CASE WHEN {_PHASE_ANY} THEN {_PHASE_TOTAL} END AS server_other_raw,
           CASE WHEN s.op_end IS NOT NULL
                THEN greatest(least(s.op_end, w.cut) - greatest(s.op_start, 0), 0) END AS tf_ops,
           CASE WHEN s.last_end IS NOT NULL
                THEN greatest(s.last_end - w.cut, 0) END AS server_after_response
    FROM win w JOIN traces t USING (source_db, trace_id)
    LEFT JOIN server s USING (source_db, trace_id)
    LEFT JOIN gaps g USING (source_db, trace_id)
), per AS (
    SELECT *, CASE WHEN server_other_raw IS NOT NULL THEN greatest(server_other_raw, 0) END
              AS server_other,  -- greatest() skips a NULL
           client_total - tf_ops AS outside_tf_ops
    FROM raw
    WHERE NOT coalesce(first_start < -{_TOL} OR first_start > cut + {_TOL}
                       OR op_start > cut + {_TOL} OR op_end < -{_TOL}
                       OR server_other_raw < -{OVERLAP_TOLERANCE} * client_total - _overlap,
                       false)
)"""
_AGGREGATE = f"""count(*) AS requests, avg(ns) / 1e6 AS mean_ms,
       {", ".join(f"quantile_cont(ns, {q}) / 1e6 AS p{round(q * 100)}_ms" for q in PERCENTILES)},
       sum(ns) / sum(client_ns) AS share_of_client"""
_LIVE = f"""{_PLACED}, long AS (
    UNPIVOT (SELECT model, client_total AS client_ns, {", ".join(PHASES)} FROM per)
    ON {", ".join(PHASES)} INTO NAME phase VALUE ns
)
SELECT model, phase, {_AGGREGATE}
FROM long WHERE ns IS NOT NULL AND NOT isnan(ns) GROUP BY model, phase
"""
_STEP_VALUES = ", ".join(ensemble_steps.STEP_PHASES)
# The rules of analysis.analyses.ensemble_steps.long_rows: the placed requests' steps
# (`<n>. <model>`) and their ensemble's own rows (step "")
_LIVE_STEPS = f"""{_PLACED}, step_values AS (
    SELECT r.ensemble AS model, CAST(r.idx AS VARCHAR) || '. ' || r.step AS step,
           x.client_total AS client_ns, {_MEASURED_COLUMNS},
           CASE WHEN {" OR ".join(f"r.{k} IS NOT NULL" for k in _MEASURED)}
                THEN greatest((r.end_ns - r.start_ns)
                              - ({" + ".join(f"coalesce(r.{k}, 0)" for k in _MEASURED)}), 0)
           END AS step_other
    FROM step_rows r JOIN per x ON x._db = r.source_db AND x._tid = r.trace_id
), step_long AS (
    UNPIVOT step_values ON {_STEP_VALUES} INTO NAME phase VALUE ns
), own_long AS (
    UNPIVOT (SELECT g.ensemble AS model, '' AS step, x.client_total AS client_ns,
                    {", ".join(f"g.{k}" for k in ensemble_steps.GAP_PHASES)}
             FROM gaps g JOIN per x ON x._db = g.source_db AND x._tid = g.trace_id)
    ON {", ".join(ensemble_steps.GAP_PHASES)} INTO NAME phase VALUE ns
)
SELECT model, step, phase, {_AGGREGATE}
FROM (SELECT * FROM step_long UNION ALL BY NAME SELECT * FROM own_long)
WHERE ns IS NOT NULL AND NOT isnan(ns) GROUP BY model, step, phase
"""

# The rules of `analysis.analyses.fidelity`: per sampled trace the live compute time (the store's
# `fidelity` attribute, else, for traces stored before it, the backend's spans: the sum of
# `compute_infer`, else the `tf_op` envelope) and the replay's model time; per model and batch
# size the quantiles of their ratio over the live samples, the ratio at the batch the server
# ran, and the slow samples against the others' replays.
_FIDELITY = f"""
WITH {_PER_TRACE_LATENCY}, infer AS (
    SELECT source_db, trace_id, sum(end_ns - start_ns)::DOUBLE AS ns
    FROM spans WHERE level = '{Level.SERVER}' AND kind = '{COMPUTE_INFER}'
    GROUP BY source_db, trace_id
), ops AS (
    SELECT source_db, trace_id, (max(end_ns) - min(start_ns))::DOUBLE AS ns
    FROM spans WHERE level = '{Level.SERVER}' AND kind = '{TF_OP_KIND}'
    GROUP BY source_db, trace_id
), every AS (
    SELECT t.source_db, t.trace_id, t.model, t.batch_size, t.created_ns,
           coalesce(t.sample_reason, '') AS reason,
           CASE WHEN t.fidelity_kept THEN t.live_compute_ns ELSE coalesce(i.ns, o.ns) END
             AS live_ns,
           CASE WHEN t.fidelity_kept THEN t.server_batch_sizes ELSE [] END AS sizes,
           CASE WHEN t.fidelity_kept THEN t.window_executions END AS executions,
           t.fidelity_causes AS causes, p.latency_ns AS replay_ns
    FROM traces t
    LEFT JOIN infer i USING (source_db, trace_id)
    LEFT JOIN ops o USING (source_db, trace_id)
    LEFT JOIN per_trace p USING (source_db, trace_id)
    WHERE t.fidelity_kept IS NOT NULL
      AND (t.fidelity_kept OR coalesce(i.ns, o.ns) IS NOT NULL OR t.sample_reason = 'slow')
), rated AS (
    SELECT *, replay_ns / CASE WHEN live_ns > 0 THEN live_ns END AS ratio FROM every
), ok AS (
    SELECT * FROM rated WHERE reason <> 'slow' AND ratio IS NOT NULL
), groups AS (
    SELECT DISTINCT model, batch_size FROM rated WHERE reason = 'slow' OR ratio IS NOT NULL
), measured AS (
    SELECT model, batch_size, count(*) AS requests,
           quantile_cont(live_ns, 0.5) / 1e6 AS live_p50_ms,
           quantile_cont(replay_ns, 0.5) / 1e6 AS replay_p50_ms,
           quantile_cont(ratio, 0.5) AS ratio_p50, quantile_cont(ratio, 0.9) AS ratio_p90,
           list_sort(list_distinct(flatten(list(sizes)))) AS server_batch_sizes,
           max(executions) AS window_executions
    FROM ok GROUP BY model, batch_size
), replays AS (
    SELECT model, batch_size, quantile_cont(replay_ns, 0.5) AS replay_p50
    FROM every WHERE replay_ns IS NOT NULL GROUP BY model, batch_size
), at_batch AS (
    SELECT o.model, o.batch_size,
           quantile_cont(r.replay_p50 / o.live_ns, 0.5) AS ratio_at_server_batch_p50
    FROM ok o JOIN replays r ON r.model = o.model AND r.batch_size = o.sizes[1]
    WHERE len(o.sizes) = 1 AND o.executions = 1 AND o.sizes[1] <> o.batch_size
    GROUP BY o.model, o.batch_size
), named AS (  -- each cause once, in the order the requests (by creation) first name it
    SELECT model, batch_size, cause, min((created_ns, source_db, trace_id, pos)) AS first
    FROM (SELECT model, batch_size, created_ns, source_db, trace_id, unnest(causes) AS cause,
                 unnest(range(len(causes))) AS pos FROM ok)
    GROUP BY model, batch_size, cause
), causes AS (
    SELECT model, batch_size, list(cause ORDER BY first) AS causes
    FROM named GROUP BY model, batch_size
), peers AS (
    SELECT model, batch_size, quantile_cont(replay_ns, 0.5) AS peer_p50
    FROM every WHERE reason <> 'slow' AND replay_ns IS NOT NULL GROUP BY model, batch_size
), slow AS (
    SELECT s.model, s.batch_size, count(*) AS slow_requests,
           CASE WHEN count(s.replay_ns) > 0 AND any_value(p.peer_p50) IS NOT NULL
                THEN count(*) FILTER (WHERE s.replay_ns >= {fidelity.SLOW_REPRODUCED}
                                      * p.peer_p50) END AS slow_reproduced
    FROM every s LEFT JOIN peers p USING (model, batch_size)
    WHERE s.reason = 'slow' GROUP BY s.model, s.batch_size
)
SELECT model, batch_size, coalesce(m.requests, 0) AS requests, live_p50_ms, replay_p50_ms,
       ratio_p50, ratio_p90, ratio_at_server_batch_p50,
       coalesce(server_batch_sizes, []) AS server_batch_sizes,
       window_executions, coalesce(c.causes, []) AS causes,
       coalesce(s.slow_requests, 0) AS slow_requests, slow_reproduced
FROM groups g LEFT JOIN measured m USING (model, batch_size)
LEFT JOIN at_batch USING (model, batch_size) LEFT JOIN causes c USING (model, batch_size)
LEFT JOIN slow s USING (model, batch_size)
ORDER BY model, batch_size
"""

# The counts behind the fidelity notes and the reason it has no table
_FIDELITY_COUNTS = f"""
WITH infer AS (
    SELECT DISTINCT source_db, trace_id FROM spans
    WHERE level = '{Level.SERVER}' AND kind IN ('{COMPUTE_INFER}', '{TF_OP_KIND}')
)
SELECT coalesce(sample_reason, 'None') AS reason, count(*) AS traces,
       count(*) FILTER (WHERE fidelity_kept IS NULL) AS not_exported,
       count(*) FILTER (WHERE NOT fidelity_kept AND i.trace_id IS NOT NULL
                        AND coalesce(sample_reason, '') <> 'slow') AS from_spans,
       count(*) FILTER (WHERE (fidelity_kept AND live_compute_ns IS NOT NULL)
                        OR (NOT fidelity_kept AND i.trace_id IS NOT NULL)) AS with_live
FROM traces t LEFT JOIN infer i USING (source_db, trace_id)
GROUP BY ALL
"""

_Q = "[" + ", ".join(str(q) for q in stream_responses.PERCENTILES) + "]"
_P = [round(q * 100) for q in stream_responses.PERCENTILES]


def _quantiles(name: str) -> str:
    return ", ".join(f"q_{name}[{i + 1}] AS {name}_p{p}" for i, p in enumerate(_P))


# The rules of `analysis.analyses.stream_responses`: per model over the sampled stream messages'
# request spans, linear percentiles of responses per request, time to the first response,
# the gaps (pooled) and latency, and the median share of latency before the first response.
_STREAM = f"""
WITH req AS (
    SELECT t.model, s.duration_ns::DOUBLE AS latency_ns,
           s.relay_response_start_offset_ns::DOUBLE AS first_ns,
           s.responses, s.response_gaps_ns AS gaps
    FROM spans s JOIN traces t USING (source_db, trace_id)
    WHERE s.level = '{Level.REQUEST}' AND s.stream_span
      AND s.responses IS NOT NULL AND s.response_gaps_ns IS NOT NULL
), per AS (
    SELECT model, count(*) AS requests,
           quantile_cont(responses, {_Q}) AS q_responses,
           quantile_cont(first_ns / 1e6, {_Q}) AS q_first_response_ms,
           quantile_cont(latency_ns / 1e6, {_Q}) AS q_latency_ms,
           quantile_cont(first_ns / CASE WHEN latency_ns > 0 THEN latency_ns END, 0.5)
             AS first_response_share
    FROM req GROUP BY model
), gaps AS (
    SELECT model, count(gap) AS gaps, quantile_cont(gap / 1e6, {_Q}) AS q_gap_ms
    FROM (SELECT model, unnest(gaps) AS gap FROM req) GROUP BY model
)
SELECT model, requests, {_quantiles("responses")}, {_quantiles("first_response_ms")},
       coalesce(g.gaps, 0) AS gaps, {_quantiles("gap_ms")}, {_quantiles("latency_ms")},
       first_response_share
FROM per LEFT JOIN gaps g USING (model) ORDER BY model
"""
_STREAM_COUNTS = f"""
SELECT count(*) FILTER (WHERE stream_span AND (responses IS NULL OR response_gaps_ns IS NULL))
         AS bad,
       count(*) FILTER (WHERE stream_span IS NULL) AS not_exported, count(*) AS requests
FROM spans WHERE level = '{Level.REQUEST}'
"""

_TRACES = """
SELECT model, count(*) AS traces, count(DISTINCT source_db) AS databases,
       min(created_ns) AS first_ns, max(created_ns) AS last_ns
FROM traces GROUP BY model ORDER BY model
"""


def fleet_tables(
    fleet_dir: Path, top: int = 10, threads: int | None = None
) -> dict[str, pd.DataFrame]:
    """Every fleet analysis over the Parquet files of `fleet_dir`, as DataFrames."""
    con = connect(fleet_dir, threads)
    try:
        out = {
            "traces": con.execute(_TRACES).df(),
            "model_latency": con.execute(_MODEL_LATENCY).df(),
            "layer_types": con.execute(_LAYER_TYPES).df(),
            "top_layers": con.execute(_TOP_LAYERS, {"top": top}).df(),
        }
        live = con.execute(_LIVE).df()
        steps = con.execute(_LIVE_STEPS).df()
        out["stream_responses"] = _stream(
            con.execute(_STREAM).df(), con.execute(_STREAM_COUNTS).fetchone()
        )
        out["fidelity"] = _fidelity(con.execute(_FIDELITY).df(), con.execute(_FIDELITY_COUNTS).df())
    finally:
        con.close()
    live["phase"] = pd.Categorical(live["phase"], categories=list(PHASES), ordered=True)
    live = live.sort_values(["model", "phase"]).reset_index(drop=True)
    live["phase"] = live["phase"].astype(str)
    out["live_breakdown"] = _with_steps(live, steps)
    return out


def _with_steps(live: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The live breakdown with an ensemble's step rows (as the report shows them), if any."""
    if steps.empty:
        return live
    order = list(dict.fromkeys(STEP_ORDER))
    steps["phase"] = pd.Categorical(steps["phase"], categories=order, ordered=True)
    steps = steps.sort_values(["model", "step", "phase"]).reset_index(drop=True)
    steps["phase"] = steps["phase"].astype(str)
    out = with_step_rows(live, steps)
    out.attrs[NOTES] = [STEPS_NOTE]
    return out


FIDELITY_TABLE = ("model", "batch_size", "requests", "live_p50_ms", "replay_p50_ms",
                  "ratio_p50", "ratio_p90", "ratio_at_server_batch_p50", "verdict",
                  "differences", "slow_requests", "slow_reproduced")  # fmt: skip
NOT_CAPTURED = "not_captured"  # a table's `attrs`: why it has no rows
NOTES = "notes"  # a table's `attrs`: what its numbers leave out or mean


def _fidelity(groups: pd.DataFrame, counts: pd.DataFrame) -> pd.DataFrame:
    """The fidelity table from `_FIDELITY`'s rows (verdict and differences worded by
    `analysis.analyses.fidelity`), its notes and, without rows, why (`_FIDELITY_COUNTS`)."""
    rows = []
    for g in groups.itertuples(index=False):
        ok = pd.DataFrame({"server_batch_sizes": [list(g.server_batch_sizes)],
                           "window_executions": [g.window_executions]})  # fmt: skip
        reasons = [*list(g.causes), *fidelity.batch_causes(ok, g.batch_size)] if g.requests else []
        rows.append({
            **g._asdict(),
            "verdict": fidelity.verdict(int(g.requests), g.ratio_p50),
            "differences": "; ".join(reasons or [fidelity.NONE_RECORDED]),
            "slow_reproduced": None if pd.isna(g.slow_reproduced) else int(g.slow_reproduced),
        })  # fmt: skip
    table = pd.DataFrame(rows, columns=list(FIDELITY_TABLE))
    notes = [fidelity.RATIO_NOTE]
    older, unexported = int(counts["from_spans"].sum()), int(counts["not_exported"].sum())
    if older:
        notes.append(
            f"{older} traces were stored before the sidecar kept their fidelity: the "
            "server's compute time is read from their backend spans (no batch window)"
        )
    if unexported and unexported < int(counts["traces"].sum()):
        notes.append(
            f"{unexported} traces come from exports without the fidelity columns (written "
            "before them) and are left out: export their stores again"
        )
    table.attrs[NOTES] = notes
    if table.empty:
        table.attrs[NOT_CAPTURED] = (
            f"every trace ({unexported}) comes from an export without the fidelity columns "
            "(written before them): export the stores again"
            if unexported and unexported == int(counts["traces"].sum())
            else fidelity.why_none(
                dict(zip(counts["reason"], counts["traces"], strict=True)),
                int(counts["with_live"].sum()),
            )
        )
    return table


def _stream(table: pd.DataFrame, counts: tuple[int, int, int] | None) -> pd.DataFrame:
    """The stream_responses table, its notes and, without rows, why (as the report says)."""
    bad, unexported, requests = counts or (0, 0, 0)
    notes = []
    if not table.empty:
        notes.append(stream_responses.NOTE)
    if bad:
        notes.append(f"{bad} stream span(s) left out: response counts or gaps not numbers")
    if unexported and unexported < requests:
        notes.append(
            f"{unexported} request spans come from exports without the stream columns "
            "(written before them) and are left out: export their stores again"
        )
    table.attrs[NOTES] = notes
    if table.empty:
        if unexported and unexported == requests:
            reason = (
                f"every request span ({unexported}) comes from an export without the stream "
                "columns (written before them): export the stores again"
            )
        else:
            reason = stream_responses.NONE
            if bad:
                reason += f" ({bad} whose response counts or gaps are not numbers)"
        table.attrs[NOT_CAPTURED] = reason
    return table


def render_text(tables: dict[str, pd.DataFrame]) -> str:
    """The fleet report as plain text, one section per analysis (its notes below it)."""
    parts = []
    for key in FLEET_ANALYSES:
        df = tables[key]
        body = "(none)" if df.empty else df.to_string(index=False, float_format=_fmt)
        if NOT_CAPTURED in df.attrs:
            body = f"not captured: {df.attrs[NOT_CAPTURED]}"
        notes = "".join(f"note: {n}\n" for n in df.attrs.get(NOTES, []))
        parts.append(f"== {key} ==\n{body}\n{notes}")
    return "\n".join(parts)


def _fmt(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"
