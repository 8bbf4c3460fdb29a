"""Damaged rows in a trace store: found while loading, skipped, counted and named.

A store written by xsp-sidecar holds integers where the analyses need integers and JSON
where they read JSON. A store edited by hand, cut by a crash of an old version or written
by another producer may not. Rather than refuse the whole database (one bad JSON text makes
SQLite's `json_extract` fail the query) or average nonsense in (a NULL or negative duration),
the loader asks SQLite, per row, whether each column it reads is sound (`CHECKS`), skips the
rows that are not and keeps a `BadRow` for each: which row, which column, why.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (pandas is imported where it is used: the SQL here needs none)
    import pandas as pd

# Largest duration accepted, in ns (about 126 years): beyond it a value is garbage, and a
# float that large does not convert to int64.
MAX_NS = 4_000_000_000_000_000_000
SKIPPED = "row skipped"
IGNORED = "value ignored"


@dataclass(frozen=True)
class BadRow:
    """One damaged row (or value) and what the loader did with it."""

    source_db: str
    table: str  # traces | spans | level_stats
    trace_id: str
    row: str  # span id (spans), level (level_stats), "" (traces)
    column: str
    reason: str
    action: str = SKIPPED  # SKIPPED: the row is left out; IGNORED: only this value is


def _name(column: str) -> str:
    return column.rsplit(".", 1)[-1]  # "s.start_ns" -> "start_ns"


def _label(column: str, text: str) -> str:
    return f"'{_name(column)}: {text}'"


def integer(column: str, nullable: bool = False) -> tuple[str, str]:
    """(condition that flags the row, SQL text of the reason) for an integer column."""
    cond = f"typeof({column}) != 'integer'"
    if nullable:
        cond += f" AND {column} IS NOT NULL"
    reason = (
        f"CASE WHEN {column} IS NULL THEN {_label(column, 'NULL')} "
        f"ELSE '{_name(column)}: not an integer (' || quote({column}) || ')' END"
    )
    return cond, reason


def positive_integer(column: str) -> tuple[str, str]:
    """A nullable integer that must be >= 1 when present (e.g. a batch size)."""
    cond = f"{column} IS NOT NULL AND (typeof({column}) != 'integer' OR {column} < 1)"
    return cond, f"'{_name(column)}: not a positive integer (' || quote({column}) || ')'"


def duration(column: str, nullable: bool = False) -> list[tuple[str, str]]:
    """Checks for a non-negative, finite number of nanoseconds."""
    number = f"typeof({column}) IN ('integer', 'real')"
    missing = f"{column} IS NULL"
    checks = [
        (
            f"NOT {number}" + (f" AND NOT {missing}" if nullable else ""),
            f"CASE WHEN {missing} THEN {_label(column, 'NULL')} "
            f"ELSE '{_name(column)}: not a number (' || quote({column}) || ')' END",
        ),
        (f"{number} AND {column} < 0", f"'{_name(column)}: negative (' || {column} || ')'"),
        (
            f"{number} AND {column} > {MAX_NS}",
            f"'{_name(column)}: out of range (' || {column} || ')'",
        ),
    ]
    return checks


def ratio(column: str) -> list[tuple[str, str]]:
    """A nullable positive finite number."""
    number = f"typeof({column}) IN ('integer', 'real')"
    return [
        (
            f"{column} IS NOT NULL AND NOT {number}",
            f"'{_name(column)}: not a number (' || quote({column}) || ')'",
        ),
        (
            f"{number} AND NOT ({column} > 0 AND {column} < 1e300)",
            f"'{_name(column)}: not a positive finite number (' || {column} || ')'",
        ),
    ]


def ordered(start: str, end: str) -> tuple[str, str]:
    """The end of an interval is not before its start."""
    ints = f"typeof({start}) = 'integer' AND typeof({end}) = 'integer'"
    return (
        f"{ints} AND {end} < {start}",
        f"'{_name(end)}: before {_name(start)} (' || ({end} - {start}) || ' ns)'",
    )


def json_object(column: str) -> tuple[str, str]:
    """A nullable JSON text (checked only when a query met malformed JSON: it parses again)."""
    return (
        f"{column} IS NOT NULL AND NOT json_valid({column})",
        f"'{_name(column)}: not valid JSON (' || quote(substr({column}, 1, 40)) || ')'",
    )


def sound_span(alias: str) -> str:
    """SQL that is true exactly where the span checks (`integer` start and end, `ordered`,
    `duration`, a nullable `integer` idx) flag nothing: the same rules as one short-circuit
    conjunction, cheaper for SQLite to evaluate on the sound rows that most rows are."""
    start, end, dur, idx = (f"{alias}.{c}" for c in ("start_ns", "end_ns", "duration_ns", "idx"))
    return (
        f"typeof({start}) = 'integer' AND typeof({end}) = 'integer' AND {end} >= {start} "
        f"AND typeof({dur}) IN ('integer', 'real') AND {dur} BETWEEN 0 AND {MAX_NS} "
        f"AND ({idx} IS NULL OR typeof({idx}) = 'integer')"
    )


def bad_expression(checks: Sequence[tuple[str, str]]) -> str:
    """SQL that is NULL for a sound row, else the first reason it is not ("column: why")."""
    return "CASE " + " ".join(f"WHEN {c} THEN {r}" for c, r in checks) + " END"


def split_reason(text: str) -> tuple[str, str]:
    column, _, why = text.partition(": ")
    return column, why


def from_frame(
    df: pd.DataFrame, source: str, table: str, row_column: str | None
) -> tuple[pd.DataFrame, list[BadRow]]:
    """Drop the rows whose `_bad` column names a damage; returns the sound rows and the
    damaged ones. `row_column` names the row within its trace (span_id, level)."""
    if "_bad" not in df.columns:
        return df, []
    bad_mask = df["_bad"].notna().to_numpy()
    rows: list[BadRow] = []
    if bad_mask.any():
        bad = df[bad_mask]
        rows = [
            BadRow(
                source,
                table,
                str(tid),
                str(rid) if row_column else "",
                *split_reason(str(why)),
            )
            for tid, rid, why in zip(
                bad["trace_id"],
                bad[row_column] if row_column else bad["trace_id"],
                bad["_bad"],
                strict=True,
            )
        ]
        df = df[~bad_mask]
    return df.drop(columns=["_bad"]).reset_index(drop=True), rows


def frame(rows: Iterable[BadRow]) -> pd.DataFrame:
    """Bad rows as a table (one row each)."""
    import pandas as pd

    cols = list(BadRow.__dataclass_fields__)
    return pd.DataFrame([asdict(r) for r in rows], columns=cols)


def summary(rows: Sequence[BadRow]) -> str:
    """One line: how many rows were skipped / values ignored, by table."""
    skipped = [r for r in rows if r.action == SKIPPED]
    ignored = [r for r in rows if r.action == IGNORED]
    parts = []
    if skipped:
        by_table: dict[str, int] = {}
        for r in skipped:
            by_table[r.table] = by_table.get(r.table, 0) + 1
        tables = ", ".join(f"{n} in {t}" for t, n in sorted(by_table.items()))
        parts.append(f"{len(skipped)} damaged rows skipped ({tables})")
    if ignored:
        parts.append(f"{len(ignored)} damaged attribute values ignored")
    return "; ".join(parts)


def describe(row: BadRow) -> str:
    """One damaged row in words: where it is and why it was skipped."""
    where = f"{row.table} trace {row.trace_id}"
    if row.row:
        where += f" {'span' if row.table == 'spans' else 'level'} {row.row}"
    return f"{where}: {row.column} {row.reason} ({row.action}; {row.source_db})"


def as_json(rows: Sequence[BadRow], limit: int = 1000) -> dict[str, Any]:
    """Count and (up to `limit`) rows, JSON-safe."""
    return {
        "count": len(rows),
        "summary": summary(rows),
        "rows": [asdict(r) for r in rows[:limit]],
        "rows_left_out": max(0, len(rows) - limit),
    }
