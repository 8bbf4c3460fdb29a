"""An in-memory trace store with the same interface as `TraceStore`, for tests of other modules.

Records go through the same row conversion as the SQLite store (attributes are JSON
round-tripped, so a non-JSON value fails here too and tuples come back as lists), and reads
return copies. Size retention counts the bytes of the JSON rows, an estimate of what SQLite
would hold.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from sidecar.trace.errors import TraceStoreError
from sidecar.trace.retention import Candidate, RetentionPolicy, expired, oldest_first, over_count
from sidecar.trace.spans import Level, LevelStats, Span, Trace
from sidecar.trace.store import (
    PendingWrite,
    level_stats_to_row,
    row_to_level_stats,
    row_to_span,
    row_to_trace,
    span_to_row,
    trace_to_row,
)

_LEVEL_RANK = {
    Level.REQUEST.value: 0,
    Level.SERVER.value: 1,
    Level.MODEL.value: 2,
    Level.LAYER.value: 3,
    Level.KERNEL.value: 4,
}


class InMemoryTraceStore:
    """Traces, spans and level statistics in dicts of rows (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._closed = False
        self._traces: dict[str, dict[str, Any]] = {}
        self._spans: dict[str, dict[str, dict[str, Any]]] = {}
        self._stats: dict[str, dict[str, dict[str, Any]]] = {}

    def write_trace(
        self, trace: Trace, spans: Sequence[Span], level_stats: Sequence[LevelStats] = ()
    ) -> None:
        self.write_batch([PendingWrite(trace.trace_id, trace, spans, level_stats)])

    def append_spans(self, trace_id: str, spans: Sequence[Span]) -> None:
        self.write_batch([PendingWrite(trace_id, None, spans)])

    def write_batch(self, writes: Sequence[PendingWrite]) -> None:
        """All or nothing, like the SQLite store: every row is converted before any is kept."""
        staged: list[tuple[str, dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]]]]
        staged = []
        for w in writes:
            records: list[Any] = list(w.spans) + list(w.level_stats)
            if w.trace is not None:
                records.append(w.trace)
            for r in records:
                if r.trace_id != w.trace_id:
                    raise ValueError(f"record belongs to trace {r.trace_id}, not {w.trace_id}")
            staged.append(
                (
                    w.trace_id,
                    None if w.trace is None else trace_to_row(w.trace),
                    [span_to_row(s) for s in w.spans],
                    [level_stats_to_row(s) for s in w.level_stats],
                )
            )
        with self._lock:
            self._check_open()
            for trace_id, trace_row, span_rows, stats_rows in staged:
                if trace_row is not None:
                    self._traces[trace_id] = trace_row
                spans = self._spans.setdefault(trace_id, {})
                for row in span_rows:
                    spans[row["span_id"]] = row
                stats = self._stats.setdefault(trace_id, {})
                for row in stats_rows:
                    stats[row["level"]] = row

    def get_trace(self, trace_id: str) -> Trace | None:
        with self._lock:
            self._check_open()
            row = self._traces.get(trace_id)
            return None if row is None else row_to_trace(dict(row))

    def spans(self, trace_id: str, level: Level | None = None) -> list[Span]:
        want = None if level is None else Level(level).value
        with self._lock:
            self._check_open()
            rows = [
                r
                for r in self._spans.get(trace_id, {}).values()
                if want is None or r["level"] == want
            ]
        rows.sort(key=lambda r: (r["start_ns"], _LEVEL_RANK.get(r["level"], 5), r["idx"]))
        return [row_to_span(dict(r)) for r in rows]

    def level_stats(self, trace_id: str) -> list[LevelStats]:
        with self._lock:
            self._check_open()
            rows = list(self._stats.get(trace_id, {}).values())
        rows.sort(key=lambda r: _LEVEL_RANK.get(r["level"], 5))
        return [row_to_level_stats(dict(r)) for r in rows]

    def list_traces(
        self, *, model: str | None = None, limit: int = 100, since_ns: int | None = None
    ) -> list[Trace]:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        with self._lock:
            self._check_open()
            rows = [
                r
                for r in self._traces.values()
                if (model is None or r["model"] == model)
                and (since_ns is None or r["created_ns"] >= since_ns)
            ]
        rows.sort(key=lambda r: (r["created_ns"], r["trace_id"]), reverse=True)
        return [row_to_trace(dict(r)) for r in rows[:limit]]

    def apply_retention(self, policy: RetentionPolicy, *, now_ns: int | None = None) -> int:
        now_ns = time.time_ns() if now_ns is None else now_ns
        with self._lock:
            self._check_open()
            candidates = self._candidates()
            doomed: set[str] = set()
            if policy.max_age_s is not None:
                doomed.update(expired(candidates, policy.max_age_s, now_ns))
            if policy.max_traces is not None:
                doomed.update(over_count(candidates, policy.max_traces))
            if policy.max_bytes is not None:
                sizes = {c.trace_id: self._size(c.trace_id) for c in candidates}
                used = sum(size for tid, size in sizes.items() if tid not in doomed)
                for c in oldest_first(candidates):
                    if used <= policy.max_bytes:
                        break
                    if c.trace_id not in doomed:
                        doomed.add(c.trace_id)
                        used -= sizes[c.trace_id]
            for trace_id in doomed:
                self._traces.pop(trace_id, None)
                self._spans.pop(trace_id, None)
                self._stats.pop(trace_id, None)
            return len(doomed)

    def used_bytes(self) -> int:
        """Estimated size: bytes of all rows as JSON."""
        with self._lock:
            ids = set(self._traces) | set(self._spans) | set(self._stats)
            return sum(self._size(t) for t in ids)

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TraceStoreError("the in-memory trace store is closed")

    def _candidates(self) -> list[Candidate]:
        out = [Candidate(tid, int(r["created_ns"])) for tid, r in self._traces.items()]
        for tid, spans in self._spans.items():
            if tid not in self._traces and spans:
                out.append(
                    Candidate(
                        tid,
                        min(s["start_ns"] for s in spans.values()),
                        has_trace=False,
                        last_ns=max(s["end_ns"] for s in spans.values()),
                    )
                )
        return out

    def _size(self, trace_id: str) -> int:
        rows: list[dict[str, Any]] = list(self._spans.get(trace_id, {}).values())
        rows += list(self._stats.get(trace_id, {}).values())
        if trace_id in self._traces:
            rows.append(self._traces[trace_id])
        return sum(len(json.dumps(r)) for r in rows)
