"""Reading trace stores: SQLite rows to Arrow record batches to DuckDB (the kernel and layer
levels) and pandas (traces, level statistics, the other levels), damaged rows counted."""
