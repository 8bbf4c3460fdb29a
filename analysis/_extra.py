"""Imported by `report.py` before any analysis: the analyses need pandas, matplotlib, duckdb,
pyarrow and ADBC's SQLite driver, which come with the `analysis` extra, not with the sidecar's
own install (the runtime image has none of them). Without them the report stops with one line
that names the extra."""

from __future__ import annotations

import importlib.util
import sys

MODULES = ("pandas", "matplotlib", "duckdb", "pyarrow", "adbc_driver_sqlite")

missing = [name for name in MODULES if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(
        f"analysis/report.py: {', '.join(missing)} not installed; "
        "install the analysis extra: pip install 'xsp-sidecar[analysis]'"
    )
