"""Schema migrations for the trace store, registered with a decorator.

Each migration runs inside one `BEGIN IMMEDIATE` transaction together with its bookkeeping
row in `schema_migrations` and the new `PRAGMA user_version`: either all three happen or none
does, so a crash or a failing migration never leaves a half-migrated database. Two processes
opening a new database at once are serialised by SQLite's write lock; the loser sees the
winner's bookkeeping row inside its own transaction and skips the migration.

Add a migration by appending a function decorated with `@MIGRATIONS(<next version>)`; never
edit one that has shipped.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlite_utils import Database

from sidecar.trace.errors import MigrationError, SchemaTooNewError

MigrationFn = Callable[[Database], None]

BOOKKEEPING_TABLE = "schema_migrations"


@dataclass(frozen=True)
class Migration:
    """One schema step: `fn(db)` runs inside the transaction that records `version`."""

    version: int
    name: str
    fn: MigrationFn


class Migrations:
    """An ordered registry of migrations; `@registry(version)` adds one."""

    def __init__(self) -> None:
        self._by_version: dict[int, Migration] = {}

    def __call__(
        self, version: int, name: str | None = None
    ) -> Callable[[MigrationFn], MigrationFn]:
        if version < 1:
            raise ValueError(f"migration versions start at 1, got {version}")

        def register(fn: MigrationFn) -> MigrationFn:
            if version in self._by_version:
                existing = self._by_version[version].name
                raise ValueError(f"migration version {version} is already registered ({existing})")
            self._by_version[version] = Migration(version, name or fn.__name__, fn)
            return fn

        return register

    def __iter__(self) -> Iterator[Migration]:
        return iter(sorted(self._by_version.values(), key=lambda m: m.version))

    def __len__(self) -> int:
        return len(self._by_version)

    @property
    def latest_version(self) -> int:
        """The schema version a fully migrated database has (0 when nothing is registered)."""
        return max(self._by_version, default=0)

    def apply(self, db: Database) -> list[Migration]:
        """Apply every pending migration, each in its own transaction; return those applied.

        Raises `SchemaTooNewError` when the database is newer than this registry and
        `MigrationError` (chained to the cause) when a migration fails.
        """
        current = user_version(db)
        if current > self.latest_version:
            raise SchemaTooNewError(
                f"the trace database has schema version {current}, but this xsp-sidecar only "
                f"knows versions up to {self.latest_version}; upgrade xsp-sidecar or use "
                "another database path"
            )
        if current == self.latest_version and current > 0:
            return []  # fast path: user_version is set in the same transaction as each row
        applied: list[Migration] = []
        for migration in self:
            if self._apply_one(db, migration):
                applied.append(migration)
        return applied

    def _apply_one(self, db: Database, migration: Migration) -> bool:
        conn = db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            db.table(BOOKKEEPING_TABLE).create(
                {"version": int, "name": str, "applied_ns": int},
                pk="version",
                if_not_exists=True,
            )
            done = applied_versions(db)
            if migration.version in done:
                conn.execute("ROLLBACK")
                return False
            migration.fn(db)
            db.table(BOOKKEEPING_TABLE).insert(
                {
                    "version": migration.version,
                    "name": migration.name,
                    "applied_ns": time.time_ns(),
                }
            )
            # PRAGMA does not take parameters; the version is an int we control.
            conn.execute(f"PRAGMA user_version = {max(done | {migration.version})}")
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, Exception):
                raise MigrationError(
                    f"schema migration {migration.version} ({migration.name}) failed and was "
                    f"rolled back: {exc}"
                ) from exc
            raise
        return True


def user_version(db: Database) -> int:
    """The database's `PRAGMA user_version` (the schema version; 0 for a new file)."""
    row = db.conn.execute("PRAGMA user_version").fetchone()
    return int(row[0]) if row else 0


def applied_versions(db: Database) -> set[int]:
    """Versions recorded in `schema_migrations` (empty when the table does not exist)."""
    try:
        rows = db.conn.execute(f"SELECT version FROM {BOOKKEEPING_TABLE}").fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return set()
        raise
    return {int(r[0]) for r in rows}


MIGRATIONS = Migrations()
"""The trace store's schema. `docs/trace-schema.md` documents the result."""


@MIGRATIONS(1, "create traces, spans, level_stats and their indexes")
def _create_tables(db: Database) -> None:
    db.table("traces").create(
        {
            "trace_id": str,
            "model": str,
            "model_version": str,
            "batch_size": int,
            "runtime": str,
            "device": str,
            "sample_reason": str,
            "sidecar_version": str,
            "status": str,
            "error": str,
            "created_ns": int,
            "attributes": str,
        },
        pk="trace_id",
    )
    db.table("spans").create(
        {
            "trace_id": str,
            "span_id": str,
            "parent_id": str,
            "level": str,
            "name": str,
            "kind": str,
            "start_ns": int,
            "end_ns": int,
            "duration_ns": int,
            "source": str,
            "run_level": str,
            "idx": int,
            "attributes": str,
        },
        pk=("trace_id", "span_id"),
    )
    db.table("level_stats").create(
        {
            "trace_id": str,
            "level": str,
            "iterations": int,
            "warmup": int,
            "trimmed_mean_ns": int,
            "median_ns": int,
            "min_ns": int,
            "max_ns": int,
            "overhead_ratio": float,
            "samples_ns": str,
        },
        pk=("trace_id", "level"),
    )
    spans = db.table("spans")
    spans.create_index(["trace_id"], index_name="idx_spans_trace_id")
    spans.create_index(["trace_id", "level"], index_name="idx_spans_trace_id_level")
    spans.create_index(["level", "kind"], index_name="idx_spans_level_kind")
    spans.create_index(["name"], index_name="idx_spans_name")
    traces = db.table("traces")
    traces.create_index(["model", "batch_size"], index_name="idx_traces_model_batch_size")
    traces.create_index(["created_ns"], index_name="idx_traces_created_ns")


@MIGRATIONS(2, "create trace_parts: each sampled trace's parts and outcome (trace.parts)")
def _create_trace_parts(db: Database) -> None:
    db.table("trace_parts").create(
        {
            "trace_id": str,
            "expected": str,  # JSON list of part names
            "received": str,  # JSON list of part names
            "absent": str,  # JSON object: part name -> why it never comes
            "deadline_ns": int,
            "state": str,  # pending, whole or incomplete
            "why": str,
        },
        pk="trace_id",
    )
    db.table("trace_parts").create_index(["state", "deadline_ns"], index_name="idx_trace_parts_due")
