"""A background writer: callers hand traces to a bounded queue; one thread stores them.

`submit` never blocks and never raises: a full queue drops the trace and counts it in
`dropped`. The thread takes up to `batch_max` queued items and writes them in one transaction;
if that fails it retries them one by one so a single bad trace (say, an attribute that is not
JSON) fails alone. Failures are counted in `failed`, logged (rate-limited) and passed to
`on_error`; successful writes are passed to `on_written` (so a caller backing off after
failures knows the store works again); the thread keeps going. Store-wide failures (disk
full, lock timeout, I/O error) are not retried item by item.

`on_stored` (optional, e.g. the OTLP export) sees every committed item on the writer thread,
after its commit; `submit_stored_elsewhere` asks the thread to read back what another process
(the profiling worker) stored for a trace and pass its replay part to `on_stored` too.
`submit_write` queues any `PendingWrite`, such as the trace assembler's events (`assembly`),
which are written in the same transactions as the parts around them; an event alone is no
record: it is not counted, and its failure is logged but not passed to `on_error` (the
records' writes say whether the store works, as they did before there were events).

Guarantee on `kill -9`: every committed trace is whole; what was still queued or in the batch
being committed is lost (it only ever lived in this process's memory).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sidecar.trace.errors import StoreFullError
from sidecar.trace.retention import RetentionPolicy
from sidecar.trace.spans import LevelStats, Source, Span, Trace
from sidecar.trace.store import DEFAULT_MIN_FREE_BYTES, PendingWrite, TraceStore, TraceStoreLike

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class _StoredElsewhere:
    """A queue item: read a trace another process stored back for `on_stored`."""

    trace_id: str


_IDLE_WAKE_S = 0.5
_LOG_EVERY_S = 10.0
_STORE_WIDE = {
    sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_BUSY,
    sqlite3.SQLITE_LOCKED,
    sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_CANTOPEN,
}


class TraceWriter:
    """Owns one store (opened here, so a bad path fails at start-up) and one writer thread.

    `path` may also be a store object (`TraceStoreLike`, e.g. a test double); the writer then
    owns it and closes it on `close()`. Counters (plain ints, exported on /metrics by
    `sidecar.trace.metrics.TraceWriterCollector`): `written` and `failed` count submitted items
    (a trace, or one `submit_spans` batch), `dropped` those refused because the queue was full
    or the writer closed; `retention_deleted` counts traces deleted by retention passes,
    `retention_errors` passes that failed; `callback_errors` calls of `on_error` /
    `on_written` / `on_stored` that raised.
    """

    def __init__(
        self,
        path: str | Path | TraceStoreLike,
        *,
        queue_size: int = 256,
        batch_max: int = 64,
        retention: RetentionPolicy | None = None,
        on_error: Callable[[Exception], None] | None = None,
        on_written: Callable[[int], None] | None = None,
        on_stored: Callable[[PendingWrite], None] | None = None,
        retention_interval_s: float = 60.0,
        busy_timeout_s: float = 5.0,
        min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    ) -> None:
        if queue_size < 1 or batch_max < 1:
            raise ValueError(f"queue_size and batch_max must be >= 1 ({queue_size}, {batch_max})")
        if isinstance(path, str | Path):
            self.store: TraceStoreLike = TraceStore(
                path, busy_timeout_s=busy_timeout_s, min_free_bytes=min_free_bytes
            )
        else:
            self.store = path
        self.retention = retention
        self.retention_interval_s = retention_interval_s
        self.on_error = on_error
        self.on_written = on_written
        self.on_stored = on_stored
        self.batch_max = batch_max
        self.written = 0
        self.dropped = 0
        self.failed = 0
        self.retention_deleted = 0
        self.retention_errors = 0
        self.callback_errors = 0
        self.last_error: Exception | None = None
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._cond = threading.Condition()
        self._accepted = 0
        self._processed = 0
        self._closing = False
        self._closed = False
        self._last_retention = float("-inf")
        self._last_log = float("-inf")
        self._unlogged = 0
        self._thread = threading.Thread(target=self._run, name="xsp-trace-writer", daemon=True)
        self._thread.start()

    # --- producer side ------------------------------------------------------------------

    def submit(
        self, trace: Trace, spans: Sequence[Span], level_stats: Sequence[LevelStats] = ()
    ) -> bool:
        """Queue a whole trace; False (counted in `dropped`) when the queue is full or closed.

        The records belong to the writer from now on: do not mutate them.
        """
        return self._offer(PendingWrite(trace.trace_id, trace, tuple(spans), tuple(level_stats)))

    def submit_spans(self, trace_id: str, spans: Sequence[Span]) -> bool:
        """Queue late spans for a trace (its row may not exist yet)."""
        return self._offer(PendingWrite(trace_id, None, tuple(spans)))

    def submit_write(self, item: PendingWrite) -> bool:
        """Queue any write, e.g. one carrying a trace assembly's event (`PendingWrite.assembly`).
        An item without records (an event alone) is not counted in `written` or `dropped`."""
        return self._offer(item)

    def submit_stored_elsewhere(self, trace_id: str) -> bool:
        """Pass the replay part of a trace another process stored to `on_stored` (read back on
        the writer thread); False when there is no `on_stored` or the queue is full."""
        with self._cond:
            if self.on_stored is None or self._closing:
                return False
            try:
                self._queue.put_nowait(_StoredElsewhere(trace_id))
            except queue.Full:
                return False
            self._accepted += 1
            return True

    def _offer(self, item: PendingWrite) -> bool:
        with self._cond:
            if not self._closing:
                try:
                    self._queue.put_nowait(item)
                except queue.Full:
                    pass
                else:
                    self._accepted += 1
                    return True
            self.dropped += _records(item)
            return False

    @property
    def queue_depth(self) -> int:
        """Items waiting in the queue (not counting the batch being written)."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written or failed; False on timeout."""
        with self._cond:
            target = self._accepted
            return self._cond.wait_for(
                lambda: self._processed >= target or not self._thread.is_alive(), timeout
            ) and (self._processed >= target)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, write what is queued (up to `timeout` s), close the store."""
        with self._cond:
            if self._closed:
                return
            self._closed = self._closing = True
            # When the queue is full the thread exits once it has drained it.
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "trace writer did not finish within %.1f s; %d queued traces may be lost",
                timeout,
                self._queue.qsize(),
            )
            return  # the thread still uses the store; it is a daemon and ends with the process
        self.store.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._maybe_apply_retention()
            try:
                first = self._queue.get(timeout=_IDLE_WAKE_S)
            except queue.Empty:
                if self._closing:
                    return
                continue
            batch: list[PendingWrite] = []
            item = first
            while True:
                if isinstance(item, PendingWrite):
                    batch.append(item)
                elif isinstance(item, _StoredElsewhere):
                    self._read_back(item.trace_id)
                    with self._cond:
                        self._processed += 1
                        self._cond.notify_all()
                if len(batch) >= self.batch_max:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._write(batch)
            elif self._closing and self._queue.empty():
                return

    def _write(self, batch: list[PendingWrite]) -> None:
        stored: list[PendingWrite] = []
        failed = 0
        try:
            try:
                self.store.write_batch(batch)
                stored = batch
            except Exception as exc:
                if len(batch) == 1 or _store_wide(exc):
                    failed = sum(_records(item) for item in batch)
                    self._report(exc, f"write of {len(batch)} item(s)", notify=failed > 0)
                else:  # find the bad item(s); the rest are written
                    for item in batch:
                        try:
                            self.store.write_batch([item])
                            stored.append(item)
                        except Exception as item_exc:
                            failed += _records(item)
                            self._report(item_exc, "write of 1 item", notify=_records(item) > 0)
        finally:
            for item in stored:  # before `flush` can return: it covers the hand-off too
                self._stored(item)
            written = sum(_records(item) for item in stored)
            with self._cond:
                self.written += written
                self.failed += failed
                self._processed += len(batch)
                self._cond.notify_all()
        if written and self.on_written is not None:
            try:
                self.on_written(written)
            except Exception:
                self.callback_errors += 1
                log.exception("trace writer on_written callback raised")

    def _stored(self, item: PendingWrite) -> None:
        if self.on_stored is None:
            return
        try:
            self.on_stored(item)
        except Exception:
            self.callback_errors += 1
            log.exception("trace writer on_stored callback raised")

    def _read_back(self, trace_id: str) -> None:
        try:
            trace = self.store.get_trace(trace_id)
            spans = replay_spans(self.store.spans(trace_id))
            stats = self.store.level_stats(trace_id)
        except Exception as exc:
            self._report(exc, f"read-back of trace {trace_id}")
            return
        if trace is not None or spans:
            self._stored(PendingWrite(trace_id, trace, spans, stats))

    def _maybe_apply_retention(self) -> None:
        if self.retention is None or self.retention.unlimited:
            return
        now = time.monotonic()
        if now - self._last_retention < self.retention_interval_s:
            return
        self._last_retention = now
        try:
            self.retention_deleted += self.store.apply_retention(self.retention)
        except Exception as exc:
            self.retention_errors += 1
            self._report(exc, "retention pass")

    def _report(self, exc: Exception, what: str, *, notify: bool = True) -> None:
        """Log (rate-limited) and keep `exc`; pass it to `on_error` when `notify` (a failed
        assembly event alone is not: the records around it report the store's state)."""
        self.last_error = exc
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S:
            more = f" (and {self._unlogged} more failures since the last report)"
            log.warning(
                "trace store %s failed: %s%s",
                what,
                exc,
                more if self._unlogged else "",
            )
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1
        if notify and self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception:
                self.callback_errors += 1
                log.exception("trace writer on_error callback raised")


def _records(item: PendingWrite) -> int:
    """1 for an item that writes records, 0 for an assembly event alone (not counted)."""
    return int(item.trace is not None or bool(item.spans) or bool(item.level_stats))


def _store_wide(exc: BaseException) -> bool:
    """True for failures that no single item caused (disk full, locks, I/O)."""
    if isinstance(exc, StoreFullError):
        return True
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, sqlite3.Error):
        cause = cause.__cause__
    code = getattr(cause, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in _STORE_WIDE


def replay_spans(spans: Iterable[Span]) -> list[Span]:
    """The spans the replay measured (what the profiling worker stores, not the live ones)."""
    return [s for s in spans if s.source is Source.REPLAY]
