"""Which traces a report reads (`TraceFilter`, the command line's filters), as SQL that SQLite
evaluates, and the checks of a span row: light (no pandas), so that `report.py` can start
reading a store's spans before it imports the analyses."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from analysis.load import damage
from sidecar.trace.spans import LIVE_ONLY, OK


class TraceNotFoundError(LookupError):
    """No trace, or more than one, matches the requested id."""


# The statuses a report reads without --include-errors: a profile (`ok`), and a trace whose
# model no replay can run (`live_only`: its live side, the relay's and the backend's spans).
LOADED = (OK, LIVE_ONLY)
LOADED_SQL = f"status IN ({', '.join(repr(s) for s in LOADED)})"


@dataclass(frozen=True)
class TraceFilter:
    """Which traces to load. Empty fields select everything."""

    models: tuple[str, ...] = ()
    trace_ids: tuple[str, ...] = ()  # full ids or unique prefixes
    batch_sizes: tuple[int, ...] = ()
    since_ns: int | None = None  # created_ns >= since_ns
    include_errors: bool = False  # traces whose profile failed (status not in LOADED)


def parse_since(text: str, now_ns: int | None = None) -> int:
    """`--since` value to epoch ns: a duration back from now (`30m`, `2h`, `7d`, `45s`),
    an ISO date/time (`2026-01-31`, `2026-01-31T12:00:00`, UTC unless it has an offset),
    or epoch nanoseconds."""
    now = time.time_ns() if now_ns is None else now_ns
    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return now - int(float(text[:-1]) * units[text[-1]] * 1e9)
    if text.isdigit():
        return int(text)
    import pandas as pd  # (only for a date)

    try:
        stamp = pd.Timestamp(text)
    except ValueError:
        raise ValueError(
            f"cannot read --since {text!r}: give a duration like 30m, 2h or 7d, an ISO "
            "date/time like 2026-01-31T12:00, or epoch nanoseconds"
        ) from None
    if stamp.tzinfo is None:
        stamp = stamp.tz_localize("UTC")
    return int(stamp.value)


def sql_where(flt: TraceFilter) -> tuple[str, list[object]]:
    clauses: list[str] = []
    params: list[object] = []
    if not flt.include_errors:
        clauses.append(LOADED_SQL)
    if flt.models:
        clauses.append(f"model IN ({','.join('?' * len(flt.models))})")
        params.extend(flt.models)
    if flt.batch_sizes:
        clauses.append(f"batch_size IN ({','.join('?' * len(flt.batch_sizes))})")
        params.extend(flt.batch_sizes)
    if flt.trace_ids:
        clauses.append("(" + " OR ".join("trace_id LIKE ? || '%'" for _ in flt.trace_ids) + ")")
        params.extend(flt.trace_ids)
    if flt.since_ns is not None:
        clauses.append("created_ns >= ?")
        params.append(flt.since_ns)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def selection(flt: TraceFilter) -> tuple[str, Sequence[object]] | None:
    """The filter's trace-id subquery and its parameters; None to read every trace's rows.
    Selecting a few traces: let SQLite pick their rows. Otherwise reading every row and
    dropping those of failed traces afterwards is faster than a lookup per row."""
    if not (flt.models or flt.trace_ids or flt.batch_sizes or flt.since_ns is not None):
        return None
    where, params = sql_where(flt)
    return f"SELECT trace_id FROM traces{where}", params


def span_checks(guard_json: bool) -> str:
    checks = [
        damage.integer("s.start_ns"),
        damage.integer("s.end_ns"),
        damage.ordered("s.start_ns", "s.end_ns"),
        *damage.duration("s.duration_ns"),
        damage.integer("s.idx", nullable=True),
    ]
    if guard_json:
        checks.append(damage.json_object("s.attributes"))
        return damage.bad_expression(checks)
    # a sound row (most rows) is told by one short conjunction; only the others are named
    return f"CASE WHEN {damage.sound_span('s')} THEN NULL ELSE {damage.bad_expression(checks)} END"
