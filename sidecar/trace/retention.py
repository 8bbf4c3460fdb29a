"""Retention of stored traces by count, total size and age.

A policy keeps the newest traces. Whole traces are deleted (trace row, spans, level stats) in
transactions, so a reader never sees half a trace. Spans whose trace row never arrived (late
OTLP spans for a trace that was not written) are deleted by age and size too, dated by their
newest `end_ns` / oldest `start_ns`.

Size is the database's live size, `(page_count - freelist_count) * page_size`: what the file
shrinks to once freed pages are returned (the store creates databases with
`auto_vacuum=INCREMENTAL`, and retention runs `PRAGMA incremental_vacuum`). Deleting rows frees
pages only as they empty, so size retention deletes the oldest traces in steps and measures
again until the database fits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlite_utils import Database

_CHUNK = 500  # trace ids per DELETE transaction
_MAX_SIZE_ROUNDS = 64


@dataclass(frozen=True)
class RetentionPolicy:
    """Limits on what the store keeps; `None` means no limit on that axis."""

    max_traces: int | None = None
    max_bytes: int | None = None
    max_age_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_traces is not None and self.max_traces < 0:
            raise ValueError(f"max_traces must be >= 0, got {self.max_traces}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {self.max_bytes}")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {self.max_age_s}")

    @property
    def unlimited(self) -> bool:
        """True when the policy never deletes anything."""
        return self.max_traces is None and self.max_bytes is None and self.max_age_s is None


@dataclass(frozen=True)
class Candidate:
    """A deletable unit: a trace, or the orphan spans of a trace id with no trace row."""

    trace_id: str
    time_ns: int  # created_ns for a trace; oldest start_ns for orphan spans
    has_trace: bool = True
    last_ns: int | None = None  # newest end_ns for orphan spans (their age)


def expired(candidates: Iterable[Candidate], max_age_s: float, now_ns: int) -> list[str]:
    """Ids older than `max_age_s` (orphan spans by their newest end)."""
    cutoff = now_ns - int(max_age_s * 1e9)
    out = []
    for c in candidates:
        when = c.time_ns if c.has_trace or c.last_ns is None else c.last_ns
        if when < cutoff:
            out.append(c.trace_id)
    return out


def over_count(candidates: Iterable[Candidate], max_traces: int) -> list[str]:
    """Trace ids beyond the newest `max_traces` (orphan spans do not count)."""
    traces = [c for c in candidates if c.has_trace]
    traces.sort(key=lambda c: (c.time_ns, c.trace_id), reverse=True)
    return [c.trace_id for c in traces[max_traces:]]


def oldest_first(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates in deletion order for size retention."""
    return sorted(candidates, key=lambda c: (c.time_ns, c.trace_id))


# --- SQLite ------------------------------------------------------------------------------


def used_bytes(db: Database) -> int:
    """Live size of the database in bytes (pages in use, WAL content included)."""
    conn = db.conn
    page_count = conn.execute("PRAGMA page_count").fetchone()[0]
    freelist = conn.execute("PRAGMA freelist_count").fetchone()[0]
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((page_count - freelist) * page_size)


def apply_to_database(db: Database, policy: RetentionPolicy, now_ns: int | None = None) -> int:
    """Apply `policy` to a trace database; return how many trace ids were deleted."""
    if policy.unlimited:
        return 0
    now_ns = time.time_ns() if now_ns is None else now_ns
    deleted: set[str] = set()
    orphans = _orphans(db) if (policy.max_age_s is not None or policy.max_bytes) else []
    if policy.max_age_s is not None:
        cutoff = now_ns - int(policy.max_age_s * 1e9)
        rows = db.conn.execute("SELECT trace_id FROM traces WHERE created_ns < ?", (cutoff,))
        ids = [r[0] for r in rows] + expired(orphans, policy.max_age_s, now_ns)
        deleted |= delete_traces(db, ids)
    if policy.max_traces is not None:
        rows = db.conn.execute(
            "SELECT trace_id FROM traces ORDER BY created_ns DESC, trace_id DESC LIMIT -1 OFFSET ?",
            (policy.max_traces,),
        )
        deleted |= delete_traces(db, [r[0] for r in rows])
    if policy.max_bytes is not None:
        deleted |= _shrink_to(
            db, policy.max_bytes, [o for o in orphans if o.trace_id not in deleted]
        )
    if deleted:
        release_free_pages(db)
    return len(deleted)


def delete_traces(db: Database, trace_ids: Sequence[str]) -> set[str]:
    """Delete whole traces (row, spans, level stats, assembly state), a chunk per
    transaction."""
    done: set[str] = set()
    ids = list(dict.fromkeys(trace_ids))
    conn = db.conn
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        marks = ",".join("?" * len(chunk))
        conn.execute("BEGIN IMMEDIATE")
        try:
            for table in ("spans", "level_stats", "trace_parts", "traces"):
                conn.execute(f"DELETE FROM {table} WHERE trace_id IN ({marks})", chunk)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        done.update(chunk)
    return done


def release_free_pages(db: Database) -> None:
    """Return freed pages to the file system (no-op unless auto_vacuum is INCREMENTAL)."""
    # Each step of this pragma frees one page, and only executescript() steps it to the end
    # (execute() stops after one step because the statement has no result columns).
    if not db.conn.in_transaction:
        db.conn.executescript("PRAGMA incremental_vacuum;")
    db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def _orphans(db: Database) -> list[Candidate]:
    rows = db.conn.execute(
        "SELECT trace_id, MIN(start_ns), MAX(end_ns) FROM spans "
        "WHERE trace_id NOT IN (SELECT trace_id FROM traces) GROUP BY trace_id"
    )
    return [Candidate(r[0], int(r[1] or 0), has_trace=False, last_ns=int(r[2] or 0)) for r in rows]


def _shrink_to(db: Database, max_bytes: int, orphans: list[Candidate]) -> set[str]:
    deleted: set[str] = set()
    for _ in range(_MAX_SIZE_ROUNDS):
        used = used_bytes(db)
        if used <= max_bytes:
            break
        traces = [
            Candidate(r[0], int(r[1] or 0))
            for r in db.conn.execute("SELECT trace_id, created_ns FROM traces")
        ]
        queue = oldest_first(traces + [o for o in orphans if o.trace_id not in deleted])
        if not queue:
            break
        # Estimate how many of the oldest traces hold the excess; delete at least one per round.
        per_trace = used / len(queue)
        count = min(len(queue), max(1, math.ceil((used - max_bytes) / per_trace)))
        deleted |= delete_traces(db, [c.trace_id for c in queue[:count]])
        release_free_pages(db)
    return deleted
