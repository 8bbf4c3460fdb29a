"""Errors raised by the trace store. Each says what went wrong and what to do about it."""

from __future__ import annotations


class TraceStoreError(Exception):
    """The trace store could not be opened, migrated, read or written."""


class StoreFullError(TraceStoreError):
    """The disk (or SQLite's page limit) is full: free space, lower retention or move --db."""


class SchemaTooNewError(TraceStoreError):
    """The database was written by a newer xsp-sidecar whose schema this version cannot read."""


class MigrationError(TraceStoreError):
    """A schema migration failed; it was rolled back together with its bookkeeping row."""
