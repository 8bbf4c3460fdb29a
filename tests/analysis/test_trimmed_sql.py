"""`across_traces_sql` (DuckDB) gives what `across_traces` (pandas) gives: the same groups in
the same order (missing key values last), the same traces per group, the same first rows'
columns and the same trimmed means (within 1e-9, NaN where there is no value), on generated
kernel-like frames with tied values, NaN, infinities, traces with several rows in a group
and groups of 1 to 20 traces."""

from __future__ import annotations

import math
import random

import duckdb
import numpy as np
import pandas as pd
import pytest

from analysis.analyses.common import across_traces
from analysis.relations import trimmed_sql
from analysis.relations.kernel_rows import KernelRows
from analysis.relations.trimmed_sql import across_traces_sql

KEYS = ["model", "batch_size", "layer", "idx", "name", "kind"]
VALUES = ["duration_ns", "flops", "dram_read_bytes", "dram_write_bytes", "achieved_occupancy"]
POOL = [0.1, 0.2, 0.3, 0.7, 1e-9, 1e9, 3.0, -0.0, 0.0, 2.5e-3]


def _kernels(seed: int, n_groups: int = 120) -> pd.DataFrame:
    """Kernel spans as the relation `kernels` has them: per group (model, batch size, layer, idx,
    name, kind) a value per trace of 1 to 20 traces, some traces with two rows, the rows
    shuffled; values drawn from a small pool (ties), NaN, now and then infinite."""
    rng = random.Random(seed)
    models = ["resnet", "bert", "Zeta", "émile"]
    layers = ["conv1", "conv1#1", "fc", "Relu_0", None]
    names = ["gemm", "winograd", "Memcpy HtoD", "relu_kernel"]
    rows = []
    for _ in range(n_groups):
        group = (
            rng.choice(models),
            rng.choice([1, 8, 32]),
            rng.choice(layers),
            rng.randrange(-1, 6),
            rng.choice(names),
            rng.choice(["kernel", "memcpy", "cpu_op"]),
        )
        traces = rng.sample(range(60), rng.randint(1, 20))
        nan_share = rng.choice([0.0, 0.2, 1.0])  # some groups without a value of a column
        for tkey in traces + rng.sample(traces, min(len(traces), rng.randint(0, 2))):
            values = [
                math.nan if rng.random() < nan_share else rng.choice(POOL) * rng.choice([1, 2])
                for _ in VALUES[1:]
            ]
            if rng.random() < 0.02:
                values[0] = rng.choice([math.inf, -math.inf])
            rows.append((tkey, *group, rng.choice([100, 250, 250, 4000]), *values,
                         rng.random() < 0.3, rng.choice(["Conv", "Gemm", None])))  # fmt: skip
    rng.shuffle(rows)
    df = pd.DataFrame(rows, columns=["tkey", *KEYS, *VALUES, "metrics_estimated", "layer_type"])
    return df.assign(
        model=df["model"].astype(pd.CategoricalDtype(sorted(models))),  # the loader's codes
        batch_size=df["batch_size"].astype("Int64"),
        run_level="kernel",
        start_ns=np.arange(len(df), dtype="int64") * 1000,
        end_ns=lambda d: d["start_ns"] + d["duration_ns"],
        estimated=df["metrics_estimated"].astype(float),
    )


def _same(got: pd.DataFrame, want: pd.DataFrame, labels: list[str], values: list[str]) -> None:
    assert len(got) == len(want)
    for col in labels:  # same groups, same order, same first rows' columns
        g = got[col].astype(object).where(got[col].notna(), None).tolist()
        w = want[col].astype(object).where(want[col].notna(), None).tolist()
        assert g == w, col
    np.testing.assert_array_equal(got["n_traces"].to_numpy(), want["n_traces"].to_numpy())
    for col in values:
        g, w = got[col].to_numpy("float64"), want[col].to_numpy("float64")
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=col)
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=0, err_msg=col)


@pytest.mark.parametrize("seed", range(6))
def test_kernel_groups_as_across_traces_gives_them(seed: int) -> None:
    kn = _kernels(seed)
    values = [*VALUES, "estimated"]
    want = across_traces(kn, KEYS, values, ["layer_type"])
    kr = KernelRows.from_frame(kn)
    source = "SELECT *, CAST(metrics_estimated AS DOUBLE) AS estimated FROM kernels"
    got = across_traces_sql(kr, source, KEYS, values, ["layer_type"])
    _same(got, want, [*KEYS, "layer_type"], values)
    assert kn.duplicated([*KEYS, "tkey"]).any()  # (traces with two rows: counted once)
    assert str(got["batch_size"].dtype) == "Int64" and got["idx"].dtype == "int64"
    assert got["n_traces"].dtype == "int64"
    assert all(got[v].dtype == "float64" for v in values)


@pytest.mark.parametrize("seed", range(3))
def test_rows_taken_by_a_condition_are_the_filtered_frames(seed: int) -> None:
    kn = _kernels(100 + seed)
    keep = kn["kind"].isin(["kernel", "cpu_op"]) & kn["flops"].notna()
    keys = ["model", "batch_size", "layer", "idx", "name"]
    want = across_traces(kn[keep], keys, ["duration_ns", "flops"], ["layer_type", "kind"])
    got = across_traces_sql(
        KernelRows.from_frame(kn),
        "kernels",
        keys,
        ["duration_ns", "flops"],
        ["layer_type", "kind"],
        where="kind IN ('kernel', 'cpu_op') AND NOT isnan(flops)",
    )
    _same(got, want, [*keys, "layer_type", "kind"], ["duration_ns", "flops"])


@pytest.mark.parametrize("part_rows", [1, 37, 500])
def test_a_source_taken_in_parts_gives_the_groups_of_one_part(
    part_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large source is aggregated a share of its groups at a time: the same groups, in
    the same key order, as in one go (and as `across_traces`)."""
    kn = _kernels(3)
    kr = KernelRows.from_frame(kn)
    whole = across_traces_sql(kr, "kernels", KEYS, VALUES, ["layer_type"])
    monkeypatch.setattr(trimmed_sql, "PART_ROWS", part_rows)
    parts = across_traces_sql(kr, "kernels", KEYS, VALUES, ["layer_type"])
    pd.testing.assert_frame_equal(parts, whole)
    _same(parts, across_traces(kn, KEYS, VALUES, ["layer_type"]), [*KEYS, "layer_type"], VALUES)


def test_no_row_taken_gives_no_group() -> None:
    got = across_traces_sql(
        KernelRows.from_frame(_kernels(7)), "kernels", KEYS, VALUES, ["layer_type"], where="false"
    )
    assert got.empty
    assert set(got.columns) == {*KEYS, "layer_type", *VALUES, "n_traces"}


def test_missing_keys_of_each_kind_sort_last_as_group_ids_orders_them() -> None:
    """Over a plain DuckDB relation: NULL strings, integers and floats in the keys; NaN and
    NULL values alike; a first column whose first row is missing."""
    rng = np.random.default_rng(5)
    n = 3000
    df = pd.DataFrame(
        {
            "tkey": rng.integers(0, 40, n),
            "s": np.array(rng.choice(["b", "a", "B", "ä", None], n), dtype=object),
            "i": pd.array(rng.choice([3, -1, 0, None], n), dtype="Int64"),
            "f": rng.choice([0.5, -2.0, np.nan], n),
            "v": np.where(rng.random(n) < 0.1, np.nan, rng.choice([1.0, 2.0, 2.0, 7.5, -3.0], n)),
            "w": rng.integers(0, 5, n),
            "first": np.array(rng.choice(["x", "y", None], n), dtype=object),
        }
    )
    con = duckdb.connect()
    con.register("frame", df.assign(row=np.arange(n)))
    keys = ["s", "i", "f"]
    want = across_traces(df, keys, ["v", "w"], ["first"])
    got = across_traces_sql(KernelRows(con), "frame", keys, ["v", "w"], ["first"])
    _same(got, want, [*keys, "first"], ["v", "w"])
    # NaN the source's SQL computes (DuckDB keeps NaN apart from NULL) is left out too
    source = "SELECT * REPLACE (coalesce(v, 'NaN'::DOUBLE) AS v) FROM frame"
    got = across_traces_sql(KernelRows(con), source, keys, ["v", "w"], ["first"])
    _same(got, want, [*keys, "first"], ["v", "w"])
    assert got["s"].isna().iloc[-1] and got["f"].isna().any()


@pytest.mark.parametrize("n", range(1, 21))
def test_the_trim_cuts_floor_of_a_fifth_from_each_end(n: int) -> None:
    """One group of `n` traces, its values 1..n shuffled: the mean of those left after
    cutting floor(0.2 n) from each end, as the profiler's rule gives it."""
    values = list(range(1, n + 1))
    random.Random(n).shuffle(values)
    df = pd.DataFrame({"tkey": range(n), "g": "x", "v": values, "row": range(n)})
    con = duckdb.connect()
    con.register("frame", df)
    got = across_traces_sql(KernelRows(con), "frame", ["g"], ["v"])
    k = math.floor(0.2 * n)
    assert got["v"].tolist() == [sum(range(k + 1, n - k + 1)) / (n - 2 * k)]
    assert got["n_traces"].tolist() == [n]
