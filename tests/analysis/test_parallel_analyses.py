"""The report runs its analyses two at a time (`TraceAnalysis.prefetch`): the same results as
one at a time, each analysis and each shared frame made once, the relations readable from any
thread. The checked-in stores (real SQLite, real DuckDB, real threads)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest

from analysis.analyses.common import AnalysisResult, Frames
from analysis.analyses.once import OncePerKey
from analysis.load.tracedb import load_traces
from analysis.relations.kernel_rows import KernelRows, kernel_rows
from analysis.trace_analysis import ANALYSES, WITHOUT_SPAN_SQL, TraceAnalysis
from tests.analysis.helpers import CPU_DB, GPU_DB, LIVE_DB


def _results(paths: list[str], workers: int) -> dict[str, object]:
    ta = TraceAnalysis.from_paths(paths)
    ta.prefetch(list(ANALYSES), workers)
    return {k: ta.result(k).to_json() for k in ANALYSES} | {
        "findings": [f.to_json() for f in ta.findings()]
    }


@pytest.mark.parametrize("paths", [[GPU_DB], [CPU_DB, GPU_DB], [LIVE_DB]], ids=str)
def test_two_at_a_time_gives_what_one_at_a_time_gives(paths: list) -> None:
    paths = [str(p) for p in paths]
    assert _results(paths, 2) == _results(paths, 1)


def test_each_analysis_runs_once_however_many_threads_ask() -> None:
    ta = TraceAnalysis.from_paths([str(GPU_DB)])
    calls: list[str] = []
    real = ta._run

    def counted(key: str) -> AnalysisResult:
        calls.append(key)
        return real(key)

    ta._run = counted  # type: ignore[method-assign]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ta.result, ["A8", "A8", "A9", "A8", "A9", "A2"]))
    assert sorted(calls) == ["A2", "A8", "A9"]
    assert got[0] is got[1] is got[3] and got[2] is got[4]


def test_once_per_key_makes_a_value_once_while_the_others_wait() -> None:
    once: OncePerKey[str, object] = OncePerKey()
    made: list[int] = []
    started = threading.Event()

    def build() -> object:
        started.set()
        time.sleep(0.05)  # (the other callers arrive while it is being made)
        made.append(1)
        return object()

    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(once.get, "x", build)
        started.wait()
        others = [pool.submit(once.get, "x", build) for _ in range(3)]
        values = {id(f.result()) for f in [first, *others]}
    assert made == [1] and len(values) == 1
    assert once.get("y", lambda: "own") == "own"  # (another key: its own value)


def test_the_analyses_said_to_need_no_span_sql_make_no_relations() -> None:
    """`WITHOUT_SPAN_SQL` is a schedule: an analysis there that made the relations would
    make the other thread wait."""
    data = load_traces([GPU_DB])
    for key in WITHOUT_SPAN_SQL:
        ta = TraceAnalysis(data)
        ta.result(key)
        assert "kernel_rows" not in ta._frames._memo._values, key
    ta = TraceAnalysis(data)
    ta.result("A8")
    assert "kernel_rows" in ta._frames._memo._values  # (what the check above looks for)


def test_the_relations_are_read_from_other_threads_with_their_own_frames() -> None:
    data = load_traces([GPU_DB])  # (held: its store's database goes with it)
    kr = kernel_rows(Frames(data))
    mine = kr.query("SELECT count(*) AS n FROM kernels")

    both = threading.Barrier(2, timeout=30)  # (each call on a thread of its own, at once)

    def elsewhere(n: int) -> pd.DataFrame:
        both.wait()
        kr.register("_mine", pd.DataFrame({"n": [n]}))  # (this thread's own frame)
        kr.execute("CREATE TEMP TABLE _own AS SELECT 1 AS x")  # (and its own temporary table)
        return kr.query("SELECT (SELECT count(*) FROM kernels) AS n, (SELECT n FROM _mine) AS m")

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(elsewhere, [1, 2]))
    assert sorted(int(g["m"].iloc[0]) for g in got) == [1, 2]
    assert all(int(g["n"].iloc[0]) == int(mine["n"].iloc[0]) > 0 for g in got)


def test_relations_over_frames_say_they_are_one_threads() -> None:
    data = load_traces([GPU_DB])
    kernels = kernel_rows(Frames(data)).query("SELECT * FROM kernels")
    kr = KernelRows.from_frame(kernels)
    assert len(kr.query("SELECT * FROM kernels")) == len(kernels)  # (its own thread reads it)
    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="one thread"):
        pool.submit(kr.query, "SELECT * FROM kernels").result()


def test_the_relations_go_with_their_frames() -> None:
    import gc

    data = load_traces([GPU_DB])
    store = data.span_store()
    con = store.cursor()

    def schemas() -> int:
        rows = con.execute(
            "SELECT count(*) FROM duckdb_schemas() WHERE database_name = 'relations' "
            "AND schema_name LIKE 'frames_%'"
        ).fetchall()
        return int(rows[0][0])

    before = schemas()
    kr = kernel_rows(Frames(data))
    kr.query("SELECT 1")
    assert schemas() == before + 1
    del kr
    gc.collect()
    assert schemas() == before


def test_an_analysis_that_ran_out_of_memory_beside_another_runs_again_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault injected: A8 raises DuckDB's out-of-memory error the first time, in a worker
    thread; `prefetch` finishes the others, then runs A8 again in the calling thread."""
    import duckdb

    from analysis import trace_analysis

    want = _results([str(GPU_DB)], 1)
    real = ANALYSES["A8"]
    failed: list[str] = []

    def once_out_of_memory(fr: Frames) -> AnalysisResult:
        if not failed:
            failed.append(threading.current_thread().name)
            raise duckdb.OutOfMemoryException("injected: failed to allocate")
        return real(fr)

    monkeypatch.setitem(trace_analysis.ANALYSES, "A8", once_out_of_memory)
    assert _results([str(GPU_DB)], 2) == want
    assert failed and failed[0] != threading.current_thread().name


def test_other_errors_of_an_analysis_fail_its_result_as_one_at_a_time_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Raised in a worker thread or in the caller's, an analysis' error is its result
    (status `error`); the other analyses are whole."""
    from analysis import trace_analysis

    def broken(fr: Frames) -> AnalysisResult:
        raise ZeroDivisionError("injected")

    monkeypatch.setitem(trace_analysis.ANALYSES, "A9", broken)
    want = _results([str(GPU_DB)], 1)
    assert want["A9"]["status"] == "error"
    assert want["A9"]["reason"] == "the analysis failed: ZeroDivisionError: injected"
    assert _results([str(GPU_DB)], 2) == want
    ta = TraceAnalysis.from_paths([str(GPU_DB)])
    ta.prefetch(list(ANALYSES), 2)
    with pytest.raises(ZeroDivisionError, match="injected"):
        ta.get_kernel_roofline()  # the DataFrame API raises the analysis' own error


def test_one_worker_runs_the_analyses_in_the_calling_thread() -> None:
    ta = TraceAnalysis.from_paths([str(GPU_DB)])
    threads: set[str] = set()
    real = ta._run

    def seen(key: str) -> AnalysisResult:
        threads.add(threading.current_thread().name)
        return real(key)

    ta._run = seen  # type: ignore[method-assign]
    ta.prefetch(list(ANALYSES), 1)
    assert threads == {threading.current_thread().name}


def test_the_store_counts_its_spans_for_several_threads_at_once() -> None:
    """The analyses ask which levels are held (`TraceData.levels`) from both threads: the
    store's own connection refuses a second caller while busy, so each count has its own."""
    data = load_traces([GPU_DB])
    store = data.span_store()
    want = [store.count("kernel"), store.count("layer")]
    start = threading.Barrier(4, timeout=30)

    def counts(_: int) -> list[int]:
        start.wait()
        return [n for _ in range(50) for n in (store.count("kernel"), store.count("layer"))]

    with ThreadPoolExecutor(4) as pool:
        for got in pool.map(counts, range(4)):
            assert got == want * 50
    assert len(data.levels()) > 0
