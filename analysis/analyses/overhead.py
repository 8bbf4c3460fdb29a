"""Per-level profiling overhead: how much each leveled run slowed the model (XSP)."""

from __future__ import annotations

import pandas as pd

from analysis.analyses.common import GROUP, AnalysisResult, Frames, across_traces, empty_result

TITLE = "Profiling overhead per level"
LEVEL_ORDER = ("model", "layer", "kernel")


def overhead(fr: Frames) -> AnalysisResult:
    """Model latency of each leveled run and its ratio to the M run, trimmed over traces."""
    if fr.data.empty:
        return empty_result("overhead", TITLE)
    ls = fr.with_meta(fr.data.level_stats)
    if ls.empty:
        return AnalysisResult(
            "overhead",
            TITLE,
            status="not_captured",
            reason="no leveled runs recorded (level_stats is empty for the selected traces)",
        )
    agg = across_traces(ls, [*GROUP, "level"], ["trimmed_mean_ns", "overhead_ratio", "iterations"])
    agg["latency_ms"] = agg["trimmed_mean_ns"] / 1e6
    agg["added_pct"] = (agg["overhead_ratio"] - 1.0) * 100.0
    order = [*LEVEL_ORDER, *sorted(set(agg["level"]) - set(LEVEL_ORDER))]
    agg["level"] = pd.Categorical(agg["level"], categories=order, ordered=True)
    agg = agg.sort_values([*GROUP, "level"]).reset_index(drop=True)
    agg["level"] = agg["level"].astype(str)
    cols = [*GROUP, "level", "iterations", "latency_ms", "overhead_ratio", "added_pct", "n_traces"]
    return AnalysisResult("overhead", TITLE, agg[cols])
