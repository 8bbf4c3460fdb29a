"""`TraceAnalysis`: the one front object over a set of traces.

Its `get_*()` methods return DataFrames (raising `NotCapturedError` with the reason when a
level or metric was not captured, or the analysis' own exception); `result(key)` and
`run_all()` return `AnalysisResult`s that carry the status, the reason and notes instead: an
analysis that raises is a result with status `error` (its section alone fails). The work is
done by small stateless modules: model_level (A1, A15), layer_level (A2-A7), kernel_level (A8,
A10-A13), roofline (A9, A14), fidelity, live, overhead, time_breakdown, compare and timeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from analysis.analyses import (
    compare,
    fidelity,
    kernel_level,
    layer_level,
    live,
    model_level,
    overhead,
    roofline,
    stream_responses,
    time_breakdown,
    timeline,
)
from analysis.analyses.common import AnalysisResult, Frames, failed
from analysis.analyses.once import OncePerKey
from analysis.findings import Finding, find
from analysis.findings import table as findings_table
from analysis.load import damage, heap
from analysis.load.columnar import SpanBatches
from analysis.load.tracedb import TraceData, TraceFilter, load_traces
from analysis.relations.kernel_rows import kernel_rows
from analysis.tuning import PARALLEL_WORKERS, SLOWEST

Analyzer = Callable[[Frames], AnalysisResult]

# XSP's analyses by id, then the ones beyond XSP, in report order.
ANALYSES: dict[str, Analyzer] = {
    "A1": model_level.model_throughput,
    "A2": layer_level.layer_table,
    "A3": layer_level.layer_latency,
    "A4": layer_level.layer_memory,
    "A5": layer_level.type_distribution,
    "A6": layer_level.latency_by_type,
    "A7": layer_level.memory_by_type,
    "A8": kernel_level.kernel_table,
    "A9": roofline.kernel_roofline,
    "A10": kernel_level.kernels_by_name,
    "A11": kernel_level.kernels_by_layer,
    "A12": kernel_level.gpu_metrics_by_layer,
    "A13": kernel_level.gpu_vs_non_gpu,
    "A14": roofline.layer_roofline,
    "A15": model_level.model_aggregate,
    "fidelity": fidelity.fidelity,
    "live_breakdown": live.live_breakdown,
    "overhead": overhead.overhead,
    "time_breakdown": time_breakdown.time_breakdown,
    "stream_responses": stream_responses.stream_responses,
}
# each analysis' title, for the section of one that raised
TITLES: dict[str, str] = {
    **layer_level.TITLES,
    **kernel_level.TITLES,
    "A1": model_level.A1_TITLE,
    "A9": roofline.A9_TITLE,
    "A14": roofline.A14_TITLE,
    "A15": model_level.A15_TITLE,
    "fidelity": fidelity.TITLE,
    "live_breakdown": live.TITLE,
    "overhead": overhead.TITLE,
    "time_breakdown": time_breakdown.TITLE,
    "stream_responses": stream_responses.TITLE,
}
XSP_IDS = tuple(f"A{i}" for i in range(1, 16))
# Analyses that need a level: in a mixed selection they say which traces lack it.
NEEDS_LEVEL = {
    **{k: "layer" for k in ("A2", "A3", "A4", "A5", "A6", "A7", "A14")},
    **{k: "kernel" for k in ("A8", "A9", "A10", "A11", "A12", "A13", "time_breakdown")},
}

USES_METRICS = ("A9", "A12", "A14", "A15")  # hardware metrics: say where they came from
# the analyses that read no kernel- or layer-level span (`kernel_rows`): `prefetch` runs
# them while another thread makes the relations the others wait for
WITHOUT_SPAN_SQL = ("A1", "fidelity", "live_breakdown", "overhead", "stream_responses")


class TraceAnalysis:
    """Analyses over traces loaded from one or more trace stores (one per pod, say)."""

    def __init__(self, data: TraceData) -> None:
        self.data = data
        self._frames = Frames(data)
        self._results: OncePerKey[str, AnalysisResult] = OncePerKey()
        self._findings: list[Finding] | None = None

    @classmethod
    def from_paths(
        cls,
        paths: Sequence[str | Path],
        flt: TraceFilter | None = None,
        first: SpanBatches | None = None,
    ) -> TraceAnalysis:
        """`first`: the first store's span reads, already started (`load_traces`)."""
        return cls(load_traces(paths, flt, first))

    # -- results with status ------------------------------------------------------------
    def result(self, key: str) -> AnalysisResult:
        """One analysis by id (`A1`..`A15`, `fidelity`, `live_breakdown`, `overhead`,
        `time_breakdown`)."""
        if key not in ANALYSES:
            raise KeyError(f"unknown analysis {key!r}; known: {', '.join(ANALYSES)}")
        return self._results.get(key, lambda: self._run(key))

    def _prefetched(self, key: str) -> AnalysisResult:
        """`result` in `prefetch`'s threads: DuckDB's out-of-memory error is raised (the
        analysis then runs again alone), not made the section's error."""
        return self._results.get(key, lambda: self._run(key, out_of_memory_raises=True))

    def _run(self, key: str, out_of_memory_raises: bool = False) -> AnalysisResult:
        try:
            return self._analyse(key)
        except duckdb.OutOfMemoryException as exc:
            if out_of_memory_raises:
                raise
            return failed(key, TITLES[key], exc)
        except Exception as exc:
            return failed(key, TITLES[key], exc)

    def _analyse(self, key: str) -> AnalysisResult:
        res = ANALYSES[key](self._frames)
        if res.ok and key in NEEDS_LEVEL:
            note = self._frames.missing_level_note(NEEDS_LEVEL[key])
            if note:
                res.notes.append(note)
        if key in USES_METRICS and res.ok:
            res.notes += self._frames.metrics_notes()
        elif key in USES_METRICS and res.status == "not_captured":
            said = [n for n in self._frames.metrics_notes() if n.startswith("metrics_level")]
            res.reason = "; ".join([res.reason, *said])
        heap.trim()  # its temporaries' pages, for the next analysis
        return res

    def prefetch(self, keys: Sequence[str], workers: int | None = None) -> None:
        """Run the analyses `keys` now, `workers` at a time (default `PARALLEL_WORKERS`:
        two), so that `result` then returns them at once. Two at a time, one analysis' SQL
        runs (without the GIL) while the other's pandas work goes on; their queries share
        DuckDB's memory limit, and an analysis that ran out of it runs again alone."""
        keys = [k for k in keys if k in ANALYSES]
        if workers is None:
            workers = PARALLEL_WORKERS
        if workers <= 1 or len(keys) < 2:
            for key in keys:
                self.result(key)
            return
        self.data.span_store()  # (made here, once, where the data was made in memory)
        # one thread makes the relations while the others run what needs none of them
        first = [lambda: kernel_rows(self._frames)]
        order = [*WITHOUT_SPAN_SQL, *SLOWEST]
        ordered = [k for k in order if k in keys] + [k for k in keys if k not in order]
        tasks = first + [partial(self._prefetched, k) for k in ordered]
        with ThreadPoolExecutor(workers, thread_name_prefix="analysis") as pool:
            running = [pool.submit(task) for task in tasks]
        # An analysis' own error is its result already (status `error`); the relations'
        # error is met again by each analysis that needs them.
        errors = [e for done in running if (e := done.exception()) is not None]
        if any(isinstance(e, duckdb.OutOfMemoryException) for e in errors):
            for key in ordered:  # two at once did not fit DuckDB's memory: one at a time
                self.result(key)

    def run_all(self, keys: Sequence[str] | None = None) -> dict[str, AnalysisResult]:
        return {k: self.result(k) for k in (keys or ANALYSES)}

    def findings(self) -> list[Finding]:
        """What the analyses say to do (see `analysis.findings`), most actionable first."""
        if self._findings is None:
            self._findings = find(self.result, self.data)
        return list(self._findings)

    def compare(
        self, base: str, new: str, labels: tuple[str, str] | None = None, top: int = 15
    ) -> AnalysisResult:
        """Compare the traces matching selector `base` with those matching `new`
        (e.g. `model=resnet,batch_size=1` vs `model=resnet,batch_size=8`)."""
        sb, sn = compare.Selector.parse(base), compare.Selector.parse(new)
        a, b = compare.split(self.data, sb, sn)
        return compare.compare(a, b, labels or (base, new), top)

    def timeline(self, trace_id: str) -> dict[str, Any]:
        """Chrome/Perfetto trace-event JSON for one trace (id or unique prefix)."""
        return timeline.trace_events(self.data, trace_id)

    # -- DataFrames (HTA style) ---------------------------------------------------------
    def get_model_throughput(self) -> pd.DataFrame:
        """A1."""
        return self.result("A1").require()

    def get_optimal_batch(self) -> dict[str, int | None]:
        """A1's optimal batch size per model (None where it is not yet known or uncertain;
        `get_batch_decision` says which and why)."""
        return dict(self.result("A1").extra.get("optimal_batch", {}))

    def get_batch_decision(self) -> dict[str, dict[str, Any]]:
        """A1's optimal-batch decision per model: status, optimal, reason, measure_next."""
        return dict(self.result("A1").extra.get("batch_decision", {}))

    def get_findings(self) -> pd.DataFrame:
        """The findings as a table (rule, subject, finding, evidence, action)."""
        return findings_table(self.findings())

    def get_skipped_rows(self) -> pd.DataFrame:
        """Damaged rows of the stores that were left out (or values ignored), and why."""
        return damage.frame(self.data.bad_rows)

    def get_layer_table(self) -> pd.DataFrame:
        """A2."""
        return self.result("A2").require()

    def get_layer_latency(self) -> pd.DataFrame:
        """A3."""
        return self.result("A3").require()

    def get_layer_memory(self) -> pd.DataFrame:
        """A4."""
        return self.result("A4").require()

    def get_layer_type_distribution(self) -> pd.DataFrame:
        """A5."""
        return self.result("A5").require()

    def get_latency_by_layer_type(self) -> pd.DataFrame:
        """A6."""
        return self.result("A6").require()

    def get_memory_by_layer_type(self) -> pd.DataFrame:
        """A7."""
        return self.result("A7").require()

    def get_kernel_table(self) -> pd.DataFrame:
        """A8."""
        return self.result("A8").require()

    def get_kernel_roofline(self) -> pd.DataFrame:
        """A9."""
        return self.result("A9").require()

    def get_kernels_by_name(self) -> pd.DataFrame:
        """A10."""
        return self.result("A10").require()

    def get_kernels_by_layer(self) -> pd.DataFrame:
        """A11."""
        return self.result("A11").require()

    def get_gpu_metrics_by_layer(self) -> pd.DataFrame:
        """A12."""
        return self.result("A12").require()

    def get_gpu_vs_non_gpu_latency(self) -> pd.DataFrame:
        """A13."""
        return self.result("A13").require()

    def get_layer_roofline(self) -> pd.DataFrame:
        """A14."""
        return self.result("A14").require()

    def get_model_aggregate(self) -> pd.DataFrame:
        """A15."""
        return self.result("A15").require()

    def get_fidelity(self) -> pd.DataFrame:
        return self.result("fidelity").require()

    def get_live_breakdown(self) -> pd.DataFrame:
        return self.result("live_breakdown").require()

    def get_overhead(self) -> pd.DataFrame:
        return self.result("overhead").require()

    def get_time_breakdown(self) -> pd.DataFrame:
        return self.result("time_breakdown").require()
