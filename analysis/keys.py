"""The analyses' keys, in report order: light (no pandas), so that the command line can list
them before the analyses are imported (`analysis.trace_analysis.ANALYSES` maps each to its
function, in this order)."""

from __future__ import annotations

ANALYSIS_KEYS = (
    *(f"A{i}" for i in range(1, 16)),
    "fidelity",
    "live_breakdown",
    "overhead",
    "time_breakdown",
    "stream_responses",
)
