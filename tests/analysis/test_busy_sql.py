"""time_breakdown's busy time (SQL over the kernel rows) against `union_ns` (pandas) on
random overlapping intervals of several traces that share one clock."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.analyses.time_breakdown import busy_ns
from analysis.relations.kernel_rows import COLUMNS, KernelRows

BASE = 1_790_000_000_000_000_001  # epoch ns: must not lose precision


def _rows(rng: np.random.Generator, n_traces: int, n: int) -> pd.DataFrame:
    tkey = rng.integers(0, n_traces, n)
    start = BASE + rng.integers(0, 10_000, n)  # every trace on the same stretch of clock
    kind = rng.choice(["kernel", "memcpy", "memset", "runtime", "cpu_op"], n)
    df = pd.DataFrame({c: pd.Series([None] * n, dtype=object) for c in COLUMNS if c != "row"})
    return df.assign(
        tkey=tkey,
        kind=kind,
        start_ns=start,
        end_ns=start + rng.integers(0, 800, n),
        duration_ns=0,
        metrics_estimated=False,
    )


def union_ns(df: pd.DataFrame) -> pd.Series:
    """Per tkey: the length of the union of its [start_ns, end_ns) intervals (pandas, int64:
    the reference the SQL is checked against)."""
    d = df[["tkey", "start_ns", "end_ns"]].sort_values(["tkey", "start_ns"], kind="stable")
    lowest = np.iinfo(np.int64).min
    cummax = d.groupby("tkey")["end_ns"].cummax().astype("int64")
    prev = cummax.groupby(d["tkey"]).shift(1, fill_value=lowest).to_numpy("int64")
    start = np.maximum(d["start_ns"].to_numpy("int64"), prev)
    contrib = np.clip(d["end_ns"].to_numpy("int64") - start, 0, None)
    return pd.Series(contrib, index=d.index).groupby(d["tkey"]).sum()


def test_the_union_of_known_intervals_at_epoch_nanoseconds() -> None:
    rows = pd.DataFrame(
        {
            "tkey": [0, 0, 0, 1],
            "kind": ["kernel", "memcpy", "kernel", "kernel"],
            "start_ns": [BASE, BASE + 5, BASE + 20, BASE],
            "end_ns": [BASE + 10, BASE + 12, BASE + 21, BASE + 3],
        }
    )
    win = pd.DataFrame(
        {"start_ns": [BASE, BASE], "end_ns": [BASE + 100, BASE + 100]},
        index=pd.Index([0, 1], name="tkey"),
    )
    full = pd.DataFrame({c: pd.Series([None] * 4, dtype=object) for c in COLUMNS})
    full = full.assign(**{c: rows[c] for c in rows}, duration_ns=0, metrics_estimated=False)
    got = busy_ns(KernelRows.from_frame(full.drop(columns="row")), win)
    assert got["busy_all"].tolist() == [13, 3]
    assert got["busy_kernel"].tolist() == [11, 3]


def _expected(rows: pd.DataFrame, win: pd.DataFrame) -> pd.DataFrame:
    dev = rows[rows["kind"].isin(["kernel", "memcpy", "memset"]) & rows["tkey"].isin(win.index)]
    w_start, w_end = dev["tkey"].map(win["start_ns"]), dev["tkey"].map(win["end_ns"])
    clipped = dev.assign(
        start_ns=np.maximum(dev["start_ns"], w_start), end_ns=np.minimum(dev["end_ns"], w_end)
    )
    clipped = clipped[clipped["end_ns"] > clipped["start_ns"]]
    busy_all = union_ns(clipped)
    busy_kernel = union_ns(clipped[clipped["kind"] == "kernel"]).reindex(busy_all.index)
    return pd.DataFrame({"busy_all": busy_all, "busy_kernel": busy_kernel.fillna(0)})


@pytest.mark.parametrize("seed", range(8))
def test_busy_time_is_the_union_per_trace(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_traces = 6
    rows = _rows(rng, n_traces, 400)
    lo = BASE + rng.integers(-500, 3_000, n_traces)
    win = pd.DataFrame(
        {"start_ns": lo, "end_ns": lo + rng.integers(0, 9_000, n_traces)},
        index=pd.Index(range(n_traces), name="tkey"),
    )
    win = win.drop(index=int(rng.integers(0, n_traces)))  # a trace without a window
    kr = KernelRows.from_frame(rows)
    got = busy_ns(kr, win).sort_index()
    want = _expected(rows, win).sort_index()
    assert got.index.tolist() == want.index.tolist()
    for col in ("busy_all", "busy_kernel"):
        assert got[col].to_numpy("int64").tolist() == want[col].to_numpy("int64").tolist(), col
