"""The SQLite trace store: traces, spans and per-level statistics in one database file.

Built on `sqlite-utils`. The database runs in WAL mode with `synchronous=NORMAL` and a busy
timeout, so readers (other connections, threads or processes, e.g. `analysis/`) read while a
writer writes, and a process killed mid-write leaves a readable file: every write is one
`BEGIN IMMEDIATE` transaction, so a trace is stored whole or not at all. The schema lives in
`migrations.py` and is documented in `docs/trace-schema.md`.

One `TraceStore` is one connection; it may be shared between threads (calls are serialised
by a lock), but a background writer should own its own store (see `writer.TraceWriter`).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlite_utils import Database

from sidecar.trace import parts
from sidecar.trace.errors import SchemaTooNewError, StoreFullError, TraceStoreError
from sidecar.trace.migrations import MIGRATIONS
from sidecar.trace.retention import RetentionPolicy, apply_to_database
from sidecar.trace.spans import Level, LevelStats, Source, Span, Trace

DEFAULT_MIN_FREE_BYTES = 1 << 20
_LEVEL_ORDER = (
    "CASE level WHEN 'request' THEN 0 WHEN 'server' THEN 1 WHEN 'model' THEN 2 "
    "WHEN 'layer' THEN 3 WHEN 'kernel' THEN 4 ELSE 5 END"
)


class TraceStoreLike(Protocol):
    """The small interface shared by `TraceStore` and the tests' in-memory store
    (`tests/harness/traces/memory.py`)."""

    def write_trace(
        self, trace: Trace, spans: Sequence[Span], level_stats: Sequence[LevelStats] = ()
    ) -> None: ...
    def append_spans(self, trace_id: str, spans: Sequence[Span]) -> None: ...
    def write_batch(self, writes: Sequence[PendingWrite]) -> None: ...
    def get_trace(self, trace_id: str) -> Trace | None: ...
    def spans(self, trace_id: str, level: Level | None = None) -> list[Span]: ...
    def level_stats(self, trace_id: str) -> list[LevelStats]: ...
    def list_traces(
        self, *, model: str | None = None, limit: int = 100, since_ns: int | None = None
    ) -> list[Trace]: ...
    def apply_retention(self, policy: RetentionPolicy) -> int: ...
    def close(self) -> None: ...


@dataclass
class PendingWrite:
    """One unit of `TraceStore.write_batch`: a whole trace, or late spans (`trace=None`);
    `assembly` tells the trace's assembly what the write is (`parts.Event`)."""

    trace_id: str
    trace: Trace | None = None
    spans: Sequence[Span] = ()
    level_stats: Sequence[LevelStats] = field(default_factory=tuple)
    assembly: parts.Event | None = None


class TraceStore:
    """A trace database at `path`, created (unless `create=False`) and migrated on open.

    Raises `TraceStoreError` with what to do when the path cannot be used: missing or
    unwritable directory, a directory or non-SQLite file at `path`, less than
    `min_free_bytes` free on its file system (`StoreFullError`), or a schema newer than this
    version (`SchemaTooNewError`).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        create: bool = True,
        busy_timeout_s: float = 5.0,
        min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    ) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._closed = False
        self._busy_timeout_s = busy_timeout_s
        _check_path(self.path, create=create, min_free_bytes=min_free_bytes)
        try:
            conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, check_same_thread=False)
        except sqlite3.Error as exc:
            raise self._error(exc, "open") from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                # Only possible before the first table exists; lets retention shrink the file.
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise TraceStoreError(
                    f"could not put the trace store at {self.path} in WAL mode (SQLite kept "
                    f"'{mode}'); use a path on a local file system"
                )
            conn.execute("PRAGMA synchronous = NORMAL")
            # Checkpoint every ~400 KB of WAL and cut the WAL back to 1 MB after: left at its
            # default (4 MB) the WAL can fill a small volume before the first checkpoint, and
            # then no checkpoint can run (bench/soak.py on a 3 MB tmpfs: a 3.1 MB WAL, a 4 KB
            # database, and writes failing after the disk was freed again).
            conn.execute("PRAGMA wal_autocheckpoint = 100")
            conn.execute("PRAGMA journal_size_limit = 1048576")
            self.db = Database(conn, execute_plugins=False)
            MIGRATIONS.apply(self.db)
        except SchemaTooNewError:
            conn.close()
            raise
        except (sqlite3.Error, TraceStoreError) as exc:
            conn.close()
            raise self._error(exc, "open") from exc

    # --- writing ------------------------------------------------------------------------

    def write_trace(
        self, trace: Trace, spans: Sequence[Span], level_stats: Sequence[LevelStats] = ()
    ) -> None:
        """Store a trace with its spans and level statistics in one transaction.

        Writing the same trace id again replaces the trace row and any span / level with the
        same key; spans appended earlier under that id are kept.
        """
        self.write_batch([PendingWrite(trace.trace_id, trace, spans, level_stats)])

    def append_spans(self, trace_id: str, spans: Sequence[Span]) -> None:
        """Store late spans (e.g. backend spans over OTLP); the trace row need not exist."""
        self.write_batch([PendingWrite(trace_id, None, spans)])

    def write_batch(self, writes: Sequence[PendingWrite]) -> None:
        """Store several traces / span batches in one transaction (all or nothing)."""
        trace_rows: list[dict[str, Any]] = []
        span_rows: list[dict[str, Any]] = []
        stats_rows: list[dict[str, Any]] = []
        for w in writes:  # convert first: a bad attribute fails before the transaction
            if w.trace is not None:
                _check_ids(w.trace_id, [w.trace], "trace")
                trace_rows.append(trace_to_row(w.trace))
            _check_ids(w.trace_id, w.spans, "span")
            _check_ids(w.trace_id, w.level_stats, "level_stats")
            span_rows.extend(span_to_row(s) for s in w.spans)
            stats_rows.extend(level_stats_to_row(s) for s in w.level_stats)
        if not (trace_rows or span_rows or stats_rows or any(w.assembly for w in writes)):
            return
        with self._transaction("write"):
            if trace_rows:
                self.db.table("traces").insert_all(trace_rows, replace=True)
            if span_rows:
                self.db.table("spans").insert_all(span_rows, replace=True)
            if stats_rows:
                self.db.table("level_stats").insert_all(stats_rows, replace=True)
            events = ((w.trace_id, w.assembly, w.trace is not None) for w in writes)
            parts.advance(self.db.conn, events)

    def apply_retention(self, policy: RetentionPolicy, *, now_ns: int | None = None) -> int:
        """Delete whole traces beyond `policy` (oldest first); return how many were deleted."""
        with self._lock:
            self._check_open()
            try:
                return apply_to_database(self.db, policy, now_ns)
            except sqlite3.Error as exc:
                raise self._error(exc, "apply retention to") from exc

    # --- reading ------------------------------------------------------------------------

    def get_trace(self, trace_id: str) -> Trace | None:
        rows = self._select("traces", "trace_id = ?", [trace_id])
        return row_to_trace(rows[0]) if rows else None

    def spans(self, trace_id: str, level: Level | None = None) -> list[Span]:
        """Spans of a trace (optionally one level) by start time, level, then index."""
        where, args = "trace_id = ?", [trace_id]
        if level is not None:
            where += " AND level = ?"
            args.append(Level(level).value)
        rows = self._select("spans", where, args, order_by=f"start_ns, {_LEVEL_ORDER}, idx")
        return [row_to_span(r) for r in rows]

    def level_stats(self, trace_id: str) -> list[LevelStats]:
        """Per-level statistics of a trace, model level first."""
        rows = self._select("level_stats", "trace_id = ?", [trace_id], order_by=_LEVEL_ORDER)
        return [row_to_level_stats(r) for r in rows]

    def list_traces(
        self, *, model: str | None = None, limit: int = 100, since_ns: int | None = None
    ) -> list[Trace]:
        """Trace headers, newest first, optionally for one model / created at or after."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        clauses: list[str] = []
        args: list[Any] = []
        if model is not None:
            clauses.append("model = ?")
            args.append(model)
        if since_ns is not None:
            clauses.append("created_ns >= ?")
            args.append(since_ns)
        rows = self._select(
            "traces",
            " AND ".join(clauses) or None,
            args,
            order_by="created_ns DESC, trace_id DESC",
            limit=limit,
        )
        return [row_to_trace(r) for r in rows]

    # --- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.db.close()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TraceStore({str(self.path)!r})"

    # --- internals ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TraceStoreError(f"the trace store at {self.path} is closed")

    @contextmanager
    def _transaction(self, doing: str) -> Iterator[None]:
        with self._lock:
            self._check_open()
            conn = self.db.conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield
                    conn.execute("COMMIT")
                finally:
                    if conn.in_transaction:  # the body or COMMIT failed
                        conn.execute("ROLLBACK")
            except sqlite3.Error as exc:
                raise self._error(exc, doing) from exc

    def _select(
        self,
        table: str,
        where: str | None,
        args: list[Any],
        *,
        order_by: str | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        with self._lock:
            self._check_open()
            try:
                return list(
                    self.db.table(table).rows_where(where, args, order_by=order_by, limit=limit)
                )
            except sqlite3.Error as exc:
                raise self._error(exc, "read from") from exc

    def _error(self, exc: BaseException, doing: str) -> TraceStoreError:
        return translate_error(exc, self.path, doing, self._busy_timeout_s)


# --- rows ---------------------------------------------------------------------------------


def trace_to_row(t: Trace) -> dict[str, Any]:
    return {
        "trace_id": t.trace_id,
        "model": t.model,
        "model_version": t.model_version,
        "batch_size": t.batch_size,
        "runtime": t.runtime,
        "device": t.device,
        "sample_reason": t.sample_reason,
        "sidecar_version": t.sidecar_version,
        "status": t.status,
        "error": t.error,
        "created_ns": t.created_ns,
        "attributes": to_json(t.attributes, f"trace {t.trace_id}"),
    }


def span_to_row(s: Span) -> dict[str, Any]:
    return {
        "trace_id": s.trace_id,
        "span_id": s.span_id,
        "parent_id": s.parent_id,
        "level": Level(s.level).value,
        "name": s.name,
        "kind": s.kind,
        "start_ns": s.start_ns,
        "end_ns": s.end_ns,
        "duration_ns": s.duration_ns,
        "source": Source(s.source).value,
        "run_level": None if s.run_level is None else Level(s.run_level).value,
        "idx": s.index,
        "attributes": to_json(s.attributes, f"span {s.span_id} ({s.name})"),
    }


def level_stats_to_row(s: LevelStats) -> dict[str, Any]:
    return {
        "trace_id": s.trace_id,
        "level": Level(s.level).value,
        "iterations": s.iterations,
        "warmup": s.warmup,
        "trimmed_mean_ns": s.trimmed_mean_ns,
        "median_ns": s.median_ns,
        "min_ns": s.min_ns,
        "max_ns": s.max_ns,
        "overhead_ratio": s.overhead_ratio,
        "samples_ns": to_json(list(s.samples_ns), f"level_stats {s.level}"),
    }


def row_to_trace(r: dict[str, Any]) -> Trace:
    return Trace(
        trace_id=r["trace_id"],
        model=r["model"] or "",
        created_ns=int(r["created_ns"] or 0),
        model_version=r["model_version"] or "",
        batch_size=r["batch_size"],
        runtime=r["runtime"] or "",
        device=r["device"] or "",
        sample_reason=r["sample_reason"] or "",
        sidecar_version=r["sidecar_version"] or "",
        status=r["status"] or "",
        error=r["error"] or "",
        attributes=from_json(r["attributes"], {}),
    )


def row_to_span(r: dict[str, Any]) -> Span:
    return Span(
        trace_id=r["trace_id"],
        span_id=r["span_id"],
        parent_id=r["parent_id"],
        level=Level(r["level"]),
        name=r["name"],
        kind=r["kind"],
        start_ns=r["start_ns"],
        end_ns=r["end_ns"],
        source=Source(r["source"]),
        duration_ns=r["duration_ns"],
        run_level=None if r["run_level"] is None else Level(r["run_level"]),
        index=r["idx"] if r["idx"] is not None else 0,
        attributes=from_json(r["attributes"], {}),
    )


def row_to_level_stats(r: dict[str, Any]) -> LevelStats:
    return LevelStats(
        trace_id=r["trace_id"],
        level=Level(r["level"]),
        iterations=r["iterations"],
        warmup=r["warmup"],
        trimmed_mean_ns=r["trimmed_mean_ns"],
        median_ns=r["median_ns"],
        min_ns=r["min_ns"],
        max_ns=r["max_ns"],
        overhead_ratio=r["overhead_ratio"],
        samples_ns=from_json(r["samples_ns"], []),
    )


def to_json(value: Any, what: str) -> str:
    """Compact JSON that SQLite's json functions accept: NaN/inf become null."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False, default=_plain)
    except ValueError:  # a non-finite float somewhere
        return json.dumps(_finite(value), separators=(",", ":"), default=_plain)
    except TypeError as exc:
        raise TraceStoreError(
            f"attributes of {what} are not JSON-serialisable ({exc}); attribute values must "
            "be str, int, float, bool, None, lists or dicts of those"
        ) from None


def from_json(text: str | None, empty: Any) -> Any:
    return empty if text is None or text == "" else json.loads(text)


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} value {value!r}")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if hasattr(value, "tolist"):
        return _finite(value.tolist())
    return value


def _check_ids(trace_id: str, records: Sequence[Any], what: str) -> None:
    for r in records:
        if r.trace_id != trace_id:
            raise ValueError(f"{what} belongs to trace {r.trace_id}, not to trace {trace_id}")


# --- peeking at a store another process writes ---------------------------------------------


def count_traces(path: str | Path, **equal: str) -> int:
    """How many traces the database at `path` holds whose columns equal `equal` (e.g.
    `sample_reason="forced"`); 0 while the file or its tables do not exist yet."""
    where = " AND ".join(f"{_column(c)} = ?" for c in equal) or "1=1"
    rows = _peek(path, f"SELECT count(*) FROM traces WHERE {where}", list(equal.values()))
    return int(rows[0][0]) if rows else 0


def failed_traces(path: str | Path, **equal: str) -> list[tuple[str, str]]:
    """(model, error) of the traces stored with status `error` whose columns equal `equal`,
    newest first; [] while the file or its tables do not exist yet."""
    where = "".join(f" AND {_column(c)} = ?" for c in equal)
    rows = _peek(
        path,
        "SELECT model, COALESCE(error, '') FROM traces WHERE status = 'error'"
        f"{where} ORDER BY created_ns DESC, trace_id DESC",
        list(equal.values()),
    )
    return [(str(model), str(error)) for model, error in rows]


def _column(name: str) -> str:
    if not name.isidentifier():
        raise ValueError(f"not a column name: {name!r}")
    return name


def _peek(path: str | Path, sql: str, args: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Rows of one query on a read-only connection (a poller never takes the write lock);
    [] when the database is missing or not ready yet."""
    if not Path(path).exists():
        return []
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)) as con:
            return list(con.execute(sql, args).fetchall())
    except sqlite3.Error:
        return []


# --- errors -------------------------------------------------------------------------------


def _check_path(path: Path, *, create: bool, min_free_bytes: int) -> None:
    where = "choose another path (--db / XSP_DB)"
    if path.is_dir():
        raise TraceStoreError(
            f"the trace store path {path} is a directory; give a file path such as "
            f"{path / 'traces.db'}"
        )
    parent = path.parent
    if not path.exists():
        if not create:
            raise TraceStoreError(f"no trace database at {path}; profile something first")
        if not parent.is_dir():
            raise TraceStoreError(
                f"cannot create the trace store at {path}: directory {parent} does not exist "
                f"(or is not a directory); create it or {where}"
            )
    if create:
        if not os.access(parent, os.W_OK | os.X_OK):
            raise TraceStoreError(
                f"cannot write the trace store at {path}: directory {parent} is not writable "
                f"(SQLite needs it for the -wal and -shm files); fix its permissions or {where}"
            )
        if path.exists() and not os.access(path, os.W_OK):
            raise TraceStoreError(
                f"cannot write the trace store at {path}: the file is read-only; fix its "
                f"permissions or {where}"
            )
        if min_free_bytes > 0:
            st = os.statvfs(parent)
            free = st.f_bavail * st.f_frsize
            if free < min_free_bytes:
                raise StoreFullError(
                    f"only {free} bytes are free on the file system of the trace store {path} "
                    f"(at least {min_free_bytes} needed); free some space, lower retention or "
                    f"{where}"
                )


def translate_error(
    exc: BaseException, path: Path, doing: str, busy_timeout_s: float = 5.0
) -> TraceStoreError:
    """Turn an SQLite error (possibly wrapped) into a `TraceStoreError` people can act on."""
    root: BaseException | None = exc
    while root is not None and not isinstance(root, sqlite3.Error):
        root = root.__cause__
    if root is None:
        return exc if isinstance(exc, TraceStoreError) else TraceStoreError(str(exc))
    code = getattr(root, "sqlite_errorcode", None)
    base = (code or 0) & 0xFF
    where = "choose another path (--db / XSP_DB)"
    if base == sqlite3.SQLITE_FULL:
        return StoreFullError(
            f"the trace store at {path} is full (disk or SQLite page limit) and could not "
            f"{doing} it: free some space, lower retention (max traces / bytes / age) or {where}"
        )
    if base == sqlite3.SQLITE_READONLY:
        return TraceStoreError(
            f"cannot {doing} the trace store at {path}: it is read-only ({root}); fix the "
            f"permissions of the file and its directory or {where}"
        )
    if base == sqlite3.SQLITE_CANTOPEN:
        return TraceStoreError(
            f"cannot open the trace store at {path} ({root}); check that its directory exists "
            f"and is writable, or {where}"
        )
    if base in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return TraceStoreError(
            f"{path} is not a readable SQLite trace database ({root}); move it aside or {where}"
        )
    if base in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return TraceStoreError(
            f"could not {doing} the trace store at {path}: another connection held the lock for "
            f"more than {busy_timeout_s:g} s ({root})"
        )
    if base == sqlite3.SQLITE_IOERR:
        return TraceStoreError(
            f"I/O error while trying to {doing} the trace store at {path} ({root}); check the "
            f"disk or {where}"
        )
    return TraceStoreError(f"could not {doing} the trace store at {path}: {root}")
