"""Load one or more SQLite trace stores, read-only: traces, level statistics and the few
spans of the other levels as pandas DataFrames, the kernel and layer levels (nearly all of a
store's spans) in DuckDB (`analysis.load.span_store.SpanStore`).

Each database is one source (e.g. one pod of a fleet). Every row keeps its `source_db`, and
`tkey` (an integer unique across all loaded databases) identifies a trace even when two
databases hold the same trace id. A store's spans are read in batches (SQLite checks the rows,
DuckDB reads the attributes the analyses use: `analysis.load.columnar`); of each batch the sound
kernel and layer rows go to DuckDB as they come (`analysis.load.arrow_spans`), the rest is cut to
its sound rows and gathered with each level's rows together (`analysis.load.level_rows`), so that
memory does not grow with the kernel and layer levels.
"""

from __future__ import annotations

import json
import sqlite3
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from analysis.load import columnar, damage, sparse_columns
from analysis.load.arrow_spans import POSITION, store_plain
from analysis.load.damage import BadRow
from analysis.load.layer_type import layer_type
from analysis.load.level_rows import LevelRows
from analysis.load.span_store import JSON_TEXT, SpanStore
from analysis.load.span_store import LEVELS as STORE_LEVELS
from analysis.load.store_file import (
    RELAY_OFFSET_COLUMNS,
    STREAM_RESPONSE_COLUMNS,
    TraceDatabaseError,
)
from analysis.load.store_file import connect_ro as _connect_ro
from analysis.load.trace_filter import LOADED_SQL, TraceFilter, selection, span_checks, sql_where
from analysis.load.trace_filter import parse_since as parse_since  # (re-exported)
from analysis.tuning import REST_ROWS
from sidecar.trace import schema
from sidecar.trace.schema import Level

# Copy-on-write (pandas 3's default): the analyses derive many frames from the spans
# (filters, `assign`, `reset_index`); without it each derivation copies every column of a
# frame of half a million rows, with it only the columns written are copied.
pd.set_option("mode.copy_on_write", True)

# Span attributes the loader reads beyond numbers and flags (`analysis.load.columnar`): the graph
# nodes a fused layer computes (ONNX Runtime: Conv+Relu -> one Conv node named after its
# output) decoded, and the shapes kept as JSON text. Attributes no analysis reads (a kernel's
# stream, a layer's parent_layer) are not loaded; the timeline export reads its trace whole.
_LAYER_JSON = (schema.INPUT_SHAPES, schema.OUTPUT_SHAPES)
_LAYER_LISTS = (schema.ORIGINAL_NODES, schema.ORIGINAL_OP_TYPES)
# The spans' string columns, held as categoricals (sorted categories): a few thousand
# distinct strings over millions of rows (`LevelRows`, `string_codes.StringCodes`). The
# names, levels and kinds share their categories: a kernel's `layer` is a layer's `name`,
# a span's `run_level` a `level`, and the analyses merge one on the other.
SPAN_CODED = (("source_db",), ("trace_id",),
              ("level", "name", "kind", "run_level", "layer", *_LAYER_JSON))  # fmt: skip
# Trace attribute keys extracted into columns of `TraceData.traces`.
TRACE_ATTRIBUTE_COLUMNS: tuple[str, ...] = (
    schema.PEAK_FLOPS_PER_S,
    schema.PEAK_DRAM_BYTES_PER_S,
    schema.PEAK_SOURCE,
    schema.KERNEL_LEVEL,
    schema.GRAPH_OPTIMIZATIONS,
    schema.LAYER_NAMES,
    "synthetic",
)


@dataclass
class TraceData:
    """Traces, spans and level statistics of the selected traces, from all sources."""

    traces: pd.DataFrame
    spans: pd.DataFrame
    level_stats: pd.DataFrame
    sources: list[str] = field(default_factory=list)
    skipped_errors: int = 0  # traces left out because their profile failed
    bad_rows: list[BadRow] = field(default_factory=list)  # damaged rows left out (named)
    failed_reasons: dict[str, int] = field(default_factory=dict)  # error -> failed traces
    # the kernel- and layer-level spans (`span_store.LEVELS`), not held in `spans`
    store: SpanStore | None = None

    def span_store(self) -> SpanStore:
        """The kernel- and layer-level spans: the loader's store, else those of `spans`
        (data made in memory)."""
        if self.store is None:
            self.store = SpanStore.from_frame(self.spans)
        return self.store

    def _others(self) -> pd.Series:
        return self.spans["level"][~self.spans["level"].isin(STORE_LEVELS)]

    def span_count(self) -> int:
        """The selected spans, every level's."""
        return len(self._others()) + sum(self.span_store().count(v) for v in STORE_LEVELS)

    def levels(self) -> list[str]:
        """The levels the selected spans hold, sorted."""
        held = {v for v in STORE_LEVELS if self.span_store().count(v)}
        return sorted({str(v) for v in self._others().dropna().unique()} | held)

    @property
    def empty(self) -> bool:
        return self.traces.empty

    def subset(self, tkeys: Sequence[int] | pd.Series) -> TraceData:
        """The same data restricted to some traces."""
        keys = set(int(k) for k in tkeys)
        return TraceData(
            traces=self.traces[self.traces["tkey"].isin(keys)].reset_index(drop=True),
            spans=self.spans[self.spans["tkey"].isin(keys)].reset_index(drop=True),
            level_stats=self.level_stats[self.level_stats["tkey"].isin(keys)].reset_index(
                drop=True
            ),
            sources=list(self.sources),
            skipped_errors=0,
            store=None if self.store is None else self.store.restricted(keys),
        )


def _trace_checks(guard_json: bool) -> str:
    checks = [
        damage.integer("created_ns"),
        damage.positive_integer("batch_size"),
        ("model IS NULL", "'model: NULL'"),
    ]
    if guard_json:
        checks.append(damage.json_object("attributes"))
    return damage.bad_expression(checks)


def _stats_checks() -> str:
    return damage.bad_expression(
        [
            *damage.duration("trimmed_mean_ns"),
            *(c for col in ("median_ns", "min_ns", "max_ns") for c in damage.duration(col, True)),
            *damage.ratio("overhead_ratio"),
            damage.integer("iterations", nullable=True),
            damage.integer("warmup", nullable=True),
        ]
    )


def _int_or_zero(column: str, alias: str) -> str:
    """An integer column whose damaged values read as 0 (the row is skipped anyway), so
    that the column stays int64 and epoch nanoseconds stay exact."""
    return f"CASE WHEN typeof({column}) = 'integer' THEN {column} ELSE 0 END AS {alias}"


def _json(column: str, expr: str, guard_json: bool) -> str:
    return f"CASE WHEN json_valid({column}) THEN {expr} END" if guard_json else expr


# traces, level_stats, failed profiles skipped and their reasons
Loaded = tuple[pd.DataFrame, pd.DataFrame, int, dict[str, int]]


def _load_one(path: Path, flt: TraceFilter, guard_json: bool = False) -> Loaded:
    """Traces and level_stats rows of one store, each with a `_bad` column that names the
    damage of a damaged row (NULL for a sound one); its spans are read afterwards, batch by
    batch (`_store_spans`). Without `guard_json` SQLite parses
    attribute JSON unchecked (fast); a malformed text then fails the query, and the load is
    repeated with every JSON text checked first."""
    conn = _connect_ro(path)
    try:
        where, params = sql_where(flt)
        trace_attr_cols = ", ".join(
            _json("attributes", f"json_extract(attributes, '$.{k}')", guard_json) + f" AS {k}"
            for k in TRACE_ATTRIBUTE_COLUMNS
        )
        traces = pd.read_sql_query(
            "SELECT trace_id, model, model_version, batch_size, runtime, device, sample_reason, "
            f"sidecar_version, status, error, {_int_or_zero('created_ns', 'created_ns')}, "
            f"attributes, {trace_attr_cols}, {_trace_checks(guard_json)} AS _bad "
            f"FROM traces{where} ORDER BY created_ns, trace_id",
            conn,
            params=params,
        )
        err_where, err_params = sql_where(TraceFilter(**{**flt.__dict__, "include_errors": True}))
        n_all = conn.execute(f"SELECT COUNT(*) FROM traces{err_where}", err_params).fetchone()[0]
        skipped = int(n_all) - len(traces)
        failed: dict[str, int] = {}
        if skipped:
            failed_where = err_where + (" AND " if err_where else " WHERE ") + f"NOT {LOADED_SQL}"
            for reason, count in conn.execute(
                "SELECT COALESCE(NULLIF(error, ''), 'status ' || quote(status)), COUNT(*) "
                f"FROM traces{failed_where} GROUP BY 1",
                err_params,
            ):
                failed[str(reason)] = int(count)
        narrow = selection(flt)
        stats = pd.read_sql_query(
            "SELECT trace_id, level, iterations, warmup, trimmed_mean_ns, median_ns, min_ns, "
            "max_ns, overhead_ratio, "
            f"CASE WHEN level = '{Level.MODEL}' THEN samples_ns END AS samples_ns, "
            f"{_stats_checks()} AS _bad FROM level_stats"
            + (f" WHERE trace_id IN ({narrow[0]})" if narrow else ""),
            conn,
            params=narrow[1] if narrow else None,
        )
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as exc:
        if "malformed JSON" in str(exc) and not guard_json:
            conn.close()
            return _load_one(path, flt, guard_json=True)
        cause = exc.__cause__ if isinstance(exc, pd.errors.DatabaseError) else None
        raise TraceDatabaseError(f"{path}: cannot read the trace store ({cause or exc})") from None
    finally:
        conn.close()
    return traces, stats, skipped, failed


_NUMERIC = (
    schema.ALLOCATED_BYTES,
    schema.FLOPS,
    schema.DRAM_READ_BYTES,
    schema.DRAM_WRITE_BYTES,
    schema.ACHIEVED_OCCUPANCY,
    schema.LEAF,
)  # fmt: skip  (leaf: NaN where not recorded)
_OBJECTS = (schema.OP_TYPE, *_LAYER_LISTS)
_FLAGS = (
    schema.FLOPS_ESTIMATED,
    schema.BYTES_ESTIMATED,
    schema.METRICS_ESTIMATED,
    schema.OUTSIDE_LAYERS,
)


def _as_float(values: Sequence[object]) -> tuple[np.ndarray, np.ndarray]:
    """Floats (None -> NaN) and the mask of values that were present but not numbers."""
    try:
        return np.array(values, dtype="float64"), np.zeros(len(values), dtype=bool)
    except (TypeError, ValueError):  # a producer wrote a string: keep what parses
        raw = pd.Series(values, dtype=object)
        out = pd.to_numeric(raw, errors="coerce").to_numpy("float64")
        return out, np.isnan(out) & raw.notna().to_numpy()


def _json_values(texts: pd.Series) -> np.ndarray:
    """JSON texts (None where absent; a categorical's or objects) decoded, one object per row
    (lists stay whole). Each distinct text is decoded once and its rows share the object (read
    it, do not modify)."""
    out = np.full(len(texts), None, dtype=object)
    if isinstance(texts.dtype, pd.CategoricalDtype):
        codes, distinct = texts.cat.codes.to_numpy(), texts.cat.categories.to_numpy(object)
        has = codes >= 0
        codes = codes[has]
    else:
        raw = texts.to_numpy(object)
        has = pd.notna(raw)
        codes, distinct = pd.factorize(raw[has])
    if has.any():
        values = json.loads("[" + ",".join(distinct) + "]")
        column = np.empty(len(values), dtype=object)
        column[:] = values
        out[has] = column[codes]
    return out


def _span_attributes(spans: pd.DataFrame, source: str) -> tuple[pd.DataFrame, list[BadRow]]:
    """The spans' typed attribute columns from the columns DuckDB read out of their JSON
    (`columnar.SpanBatches`): numbers as float64, flags as booleans, objects decoded. A
    value that is not a number where one is expected is left out and named."""
    bad: list[BadRow] = []
    wrong = spans["_wrong"].to_numpy(object)
    for pos in np.flatnonzero(pd.notna(wrong)):
        for key, value in json.loads("{" + wrong[pos] + "}").items():
            bad.append(
                BadRow(
                    source,
                    "spans",
                    str(spans["trace_id"].iat[pos]),
                    str(spans["span_id"].iat[pos]),
                    f"attributes.{key}",
                    f"not a number ({value!r})",
                    damage.IGNORED,
                )
            )
    columns: dict[str, Any] = {
        "start_ns": spans["start_ns"].to_numpy("int64"),
        "end_ns": spans["end_ns"].to_numpy("int64"),
        "duration_ns": spans["duration_ns"].to_numpy("int64"),
        "idx": spans["idx"].to_numpy("int64"),
    }
    for key in _NUMERIC:
        columns[key] = spans[key].to_numpy("float64")
    for key in _FLAGS:
        columns[key] = spans[key].to_numpy("float64") > 0
    for key in _OBJECTS:
        columns[key] = _json_values(spans[key])
    for col in RELAY_OFFSET_COLUMNS.values():  # the relay's marks (request spans only)
        columns[col] = spans[col].to_numpy("float64")
    for col in STREAM_RESPONSE_COLUMNS:  # a stream message's responses (request spans only)
        columns[col] = _json_values(spans[col])
    rest = spans[["trace_id", "span_id", "level", "name", "kind", "run_level",
                  *_LAYER_JSON, "layer"]]  # fmt: skip
    out = pd.concat([rest, pd.DataFrame(columns, index=spans.index)], axis=1)
    return out, bad


def _trace_attributes(traces: pd.DataFrame, source: str) -> tuple[pd.DataFrame, list[BadRow]]:
    """Parse each trace's attribute JSON; a trace whose attributes are not a JSON object is
    skipped. Non-numeric peaks are ignored (the trace then has no roofline)."""
    parsed: list[dict[str, Any]] = []
    bad: list[BadRow] = []
    keep = np.ones(len(traces), dtype=bool)
    for i, (tid, text) in enumerate(zip(traces["trace_id"], traces["attributes"], strict=True)):
        try:
            value = json.loads(text) if text else {}
        except ValueError:
            value = None
        if not isinstance(value, dict):
            keep[i] = False
            bad.append(BadRow(source, "traces", str(tid), "", "attributes", "not a JSON object"))
            parsed.append({})
            continue
        parsed.append(value)
    traces = traces.assign(attributes=parsed)
    for col in (schema.PEAK_FLOPS_PER_S, schema.PEAK_DRAM_BYTES_PER_S):
        values, wrong = _as_float(list(traces[col]))
        traces[col] = values
        for i in np.flatnonzero(wrong & keep).tolist():
            bad.append(
                BadRow(
                    source,
                    "traces",
                    str(traces["trace_id"].iat[i]),
                    "",
                    f"attributes.{col}",
                    f"not a number ({traces[col].iat[i]!r})",
                    damage.IGNORED,
                )
            )
    return traces[keep].reset_index(drop=True), bad


def _samples(stats: pd.DataFrame, source: str) -> tuple[list[list[float] | None], list[BadRow]]:
    """The M run's per-iteration latencies (JSON lists); damaged ones are ignored."""
    out: list[list[float] | None] = []
    bad: list[BadRow] = []
    rows = zip(stats["trace_id"], stats["level"], stats["samples_ns"], strict=True)
    for tid, level, text in rows:
        if text is None:
            out.append(None)
            continue
        try:
            values = [float(v) for v in json.loads(text)]
            if not all(0 <= v < damage.MAX_NS for v in values):
                raise ValueError
            out.append(values)
        except (ValueError, TypeError):
            out.append(None)
            bad.append(
                BadRow(
                    source,
                    "level_stats",
                    str(tid),
                    str(level),
                    "samples_ns",
                    f"not a list of durations ({str(text)[:40]!r})",
                    damage.IGNORED,
                )
            )
    return out, bad


def _normalize(
    traces: pd.DataFrame, stats: pd.DataFrame, source: str
) -> tuple[pd.DataFrame, pd.DataFrame, list[BadRow], list[BadRow]]:
    """Typed columns that do not depend on which values a database happens to hold, with
    damaged rows skipped (and named); returns traces, level stats and the damaged rows of
    each."""
    traces, bad = damage.from_frame(traces, source, "traces", None)
    traces, bad_attrs = _trace_attributes(traces, source)
    bad += bad_attrs
    traces["batch_size"] = pd.to_numeric(traces["batch_size"]).astype("Int64")
    traces["created_ns"] = traces["created_ns"].astype("int64")
    stats, bad_stats = damage.from_frame(stats, source, "level_stats", "level")
    for col in ("iterations", "warmup", "trimmed_mean_ns", "median_ns", "min_ns", "max_ns",
                "overhead_ratio"):  # fmt: skip
        stats[col] = pd.to_numeric(stats[col])
    stats["samples_ns"], bad_samples = _samples(stats, source)
    return traces, stats, bad, bad_stats + bad_samples


def _store_spans(
    batches: columnar.SpanBatches,
    source: str,
    keys: pd.Series,
    into: LevelRows,
    store: SpanStore,
) -> tuple[list[BadRow], list[BadRow]]:
    """Take one store's spans batch by batch: of each batch, the sound rows of the traces in
    `keys` (trace id -> tkey), the kernel and layer levels into `store`, the others into
    `into`, typed, with `source_db` and `tkey` and without `span_id` (which only names
    damaged rows). Returns the damaged rows and the ignored
    attribute values. SQLite checks each row and joins a kernel's layer (its parent, or its
    launch's parent); DuckDB reads the attributes (analysis/load/columnar.py). The CUDA API
    records themselves (runtime/driver) serve only that join and the timeline export (which
    reads its trace in full), so the bulk load leaves them out."""
    bad: list[BadRow] = []
    bad_attrs: list[BadRow] = []
    for table in _rest(batches, keys, store):
        spans, bad_rows = damage.from_frame(columnar.pandas(table), source, "spans", "span_id")
        del table
        kept = spans[[POSITION, *JSON_TEXT]]  # (the stored layers keep these as JSON text)
        spans, ignored = _span_attributes(spans, source)
        spans[POSITION] = kept[POSITION]
        bad += bad_rows
        bad_attrs += ignored
        mask = spans["trace_id"].isin(keys.index)
        if not mask.all():  # spans of failed (or damaged) traces
            spans = spans[mask]
        spans = spans.drop(columns="span_id")
        spans.insert(
            0, "source_db", pd.Categorical.from_codes(np.zeros(len(spans), np.int8), [source])
        )
        spans.insert(1, "tkey", _tkeys(spans["trace_id"], keys))
        level = spans["level"]
        for name in STORE_LEVELS:  # these levels go to DuckDB, the rest is held here
            rows = (level == name).to_numpy()
            if rows.any():
                taken = spans[rows]
                if name == "layer":
                    json_text = {c: kept[c] for c in JSON_TEXT}
                    taken = taken.assign(type=layer_type(taken), **json_text)
                store.add(name, taken.rename(columns={POSITION: "row"}))
        held = ~level.isin(STORE_LEVELS).to_numpy()
        into.add((spans if held.all() else spans[held]).drop(columns=POSITION))
    return bad, bad_attrs


def _rest(batches: columnar.SpanBatches, keys: pd.Series, store: SpanStore) -> Iterator[pa.Table]:
    """The rows of `batches` that `store_plain` leaves (the other levels, damaged rows, rows
    with an ignored value: a few per batch), gathered into tables of `REST_ROWS` or more:
    each table costs the pandas way a hundredth of a second whatever its size."""
    held: list[pa.Table] = []
    rows = 0
    for table in batches:
        positions = pa.array(store.positions(table.num_rows))
        rest = store_plain(table.append_column(POSITION, positions), keys, store)
        del table
        if rest.num_rows:
            held.append(rest)
            rows += rest.num_rows
        if rows >= REST_ROWS:
            yield pa.concat_tables(held)
            held, rows = [], 0
    if held:
        yield pa.concat_tables(held)


def _tkeys(trace_ids: pd.Series, keys: pd.Series) -> np.ndarray:
    """Each span's tkey (`keys`: trace id -> tkey, holding every id of `trace_ids`), looked
    up once per distinct id where the ids are a categorical's."""
    if isinstance(trace_ids.dtype, pd.CategoricalDtype):
        per_id = keys.reindex(trace_ids.cat.categories).to_numpy()
        return per_id[trace_ids.cat.codes.to_numpy()].astype("int64")
    return trace_ids.map(keys).astype("int64").to_numpy()


def _start_spans(path: Path, flt: TraceFilter) -> columnar.SpanBatches:
    """The store's span reads, started (they run while its traces are read). A store they
    cannot start on is reported as the traces' read reports it."""
    if (batches := columnar.SpanBatches.started(path, flt)) is None:
        _load_one(path, flt)  # (raises, naming what is wrong with the store)
        batches = columnar.SpanBatches(path, span_checks(False), *(selection(flt) or (None, ())))
    return batches


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    non_empty = [f for f in frames if not f.empty]
    if len(non_empty) == 1:
        return non_empty[0].reset_index(drop=True)
    with warnings.catch_warnings():  # all-NA attribute columns in one source are expected
        warnings.simplefilter("ignore", FutureWarning)
        return pd.concat(non_empty or frames[:1], ignore_index=True)


def load_traces(
    paths: Sequence[str | Path],
    flt: TraceFilter | None = None,
    first: columnar.SpanBatches | None = None,
) -> TraceData:
    """Read the selected traces of every database in `paths` (opened read-only). The spans
    come batch by batch; the kernel and layer levels go to `TraceData.store` (the analyses
    read them through SQL: `kernel_rows`), the frame the others make holds each level's rows
    together (`LevelRows`), so that the analyses take a level as a slice of it (`Frames.at`),
    not as a second copy. `first`: the first store's span reads, already started under `flt`
    (`SpanBatches.started`)."""
    flt = flt or TraceFilter()
    if not paths:
        raise TraceDatabaseError("no trace database given")
    all_traces, all_stats = [], []
    spans = LevelRows(SPAN_CODED, sparse_columns.HELD_SPARSE)
    store = SpanStore()
    skipped = 0
    bad_rows: list[BadRow] = []
    failed_reasons: dict[str, int] = {}
    sources: list[str] = []
    next_key = 0
    for raw in paths:
        path = Path(raw)
        source = str(raw)
        if first is not None:
            started, first = first, None
        else:
            started = _start_spans(path, flt)
        with started as batches:
            traces, stats, n_skipped, failed = _load_one(path, flt)
            traces, stats, bad, bad_stats = _normalize(traces, stats, source)
            keys = pd.Series(range(next_key, next_key + len(traces)), index=traces["trace_id"])
            bad_spans, bad_attrs = _store_spans(batches, source, keys, spans, store)
        for reason, count in failed.items():
            failed_reasons[reason] = failed_reasons.get(reason, 0) + count
        skipped += n_skipped
        sources.append(source)
        next_key += len(traces)
        bad_rows += bad + bad_spans + bad_stats + bad_attrs
        stats = stats[stats["trace_id"].isin(keys.index)].reset_index(drop=True)
        for df in (traces, stats):
            df.insert(0, "source_db", source)
            df.insert(1, "tkey", df["trace_id"].map(keys).astype("int64"))
        all_traces.append(traces)
        all_stats.append(stats)
    traces, stats = (_concat(f) for f in (all_traces, all_stats))
    store.flush()
    frame = spans.frame()
    return TraceData(traces, frame, stats, sources, skipped, bad_rows, failed_reasons, store)


def model_counts(paths: Sequence[str | Path]) -> dict[str, int]:
    """Model name -> number of traces, over every readable store in `paths` (for telling a
    user which models exist when a filter matched none)."""
    counts: dict[str, int] = {}
    for raw in paths:
        try:
            conn = _connect_ro(Path(raw))
        except TraceDatabaseError:
            continue
        try:
            for model, n in conn.execute("SELECT model, COUNT(*) FROM traces GROUP BY model"):
                counts[str(model)] = counts.get(str(model), 0) + int(n)
        except sqlite3.DatabaseError:
            pass
        finally:
            conn.close()
    return counts


def trace_spans(source: str | Path, trace_id: str) -> list[dict[str, Any]]:
    """Every column and attribute of one trace's spans (for exports that show everything;
    the bulk load keeps only what the analyses need)."""
    conn = _connect_ro(Path(source))
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute(
            "SELECT * FROM spans WHERE trace_id = ? ORDER BY start_ns, idx", (trace_id,)
        ).fetchall()
    finally:
        conn.close()
    out = []
    for r in rows:
        d = dict(r)
        try:
            d["attributes"] = json.loads(d["attributes"]) if d["attributes"] else {}
        except ValueError:
            d["attributes"] = {"damaged_attributes": str(d["attributes"])[:200]}
        if not isinstance(d["attributes"], dict):
            d["attributes"] = {"damaged_attributes": str(d["attributes"])[:200]}
        out.append(d)
    return out
