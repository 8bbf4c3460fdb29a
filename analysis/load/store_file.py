"""Opening a trace store read-only for the analyses, and the one error a person reads when a
file is not one. Below `tracedb` and `columnar`, which both open stores."""

from __future__ import annotations

import sqlite3
from pathlib import Path

REQUIRED_TABLES = ("traces", "spans", "level_stats")
# The columns that name one trace's run: its store, its id, the model and what it ran on
TRACE_IDENTITY = (
    "source_db",
    "trace_id",
    "model",
    "model_version",
    "batch_size",
    "device",
    "runtime",
)
# The relay's marks of a live call, stored on its request span (epoch ns), and the columns
# the loaders give them: offsets from the span's start, exact in float64.
RELAY_MARKS: tuple[str, ...] = ("relay_request_end_ns", "relay_response_start_ns")
RELAY_OFFSET_COLUMNS = {k: k.removesuffix("_ns") + "_offset_ns" for k in RELAY_MARKS}
# A sampled stream message's responses on its request span (docs/contracts.md), loaded as the
# JSON text of their values (NULL where a span has none): the report's store only.
STREAM_RESPONSE_COLUMNS: tuple[str, ...] = ("responses", "response_gaps_ns")


class TraceDatabaseError(Exception):
    """A database could not be read as an xsp-sidecar trace store."""


def connect_ro(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise TraceDatabaseError(f"{path}: no such file (expected an xsp-sidecar trace database)")
    uri = path.resolve().as_uri()
    try:
        try:
            conn = sqlite3.connect(f"{uri}?mode=ro", uri=True)
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
        except sqlite3.OperationalError:
            # A WAL-mode store in a directory we cannot write (no -shm file can be created):
            # read the file as it is on disk.
            conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True)
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
    except sqlite3.DatabaseError as exc:
        raise TraceDatabaseError(f"{path}: not a readable SQLite database ({exc})") from None
    missing = [t for t in REQUIRED_TABLES if t not in names]
    if missing:
        conn.close()
        raise TraceDatabaseError(
            f"{path}: not an xsp-sidecar trace store (missing tables: {', '.join(missing)}); "
            "produce one with `xsp-sidecar profile --db FILE` or `xsp-sidecar serve --db FILE`"
        )
    return conn
