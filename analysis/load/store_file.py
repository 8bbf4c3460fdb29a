"""Opening a trace store read-only for the analyses, and the one error a person reads when a
file is not one, or is a store of a newer schema than this analysis knows (`PRAGMA
user_version` above `sidecar.trace.schema.SCHEMA_VERSION`). Below `tracedb` and `columnar`,
which both open stores."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sidecar.trace import schema

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
RELAY_MARKS: tuple[str, ...] = (schema.RELAY_REQUEST_END_NS, schema.RELAY_RESPONSE_START_NS)
RELAY_OFFSET_COLUMNS = {k: k.removesuffix("_ns") + "_offset_ns" for k in RELAY_MARKS}
# A sampled stream message's responses on its request span (docs/contracts.md), loaded as the
# JSON text of their values (NULL where a span has none): the report's store only.
STREAM_RESPONSE_COLUMNS: tuple[str, ...] = (schema.RESPONSES, schema.RESPONSE_GAPS_NS)


class TraceDatabaseError(Exception):
    """A database could not be read as an xsp-sidecar trace store."""


class SchemaTooNewError(TraceDatabaseError):
    """The store was written by a newer xsp-sidecar, with a schema this analysis does not know."""


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
    check_version(conn, path)
    return conn


def check_version(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse (and close) a store whose schema is newer than `schema.SCHEMA_VERSION`: its
    columns or attributes may mean what this analysis cannot know. Older stores are read."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > schema.SCHEMA_VERSION:
        conn.close()
        raise SchemaTooNewError(
            f"{path} has trace schema version {version}; this analysis reads versions up to "
            f"{schema.SCHEMA_VERSION}: upgrade xsp-sidecar"
        )
