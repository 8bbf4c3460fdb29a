"""Trace records (spans, traces, level statistics) and their SQLite store."""
