"""A13's GPU time per layer call (SQL over the kernel and layer rows) against the rule it
replaced, in pandas: per (trace, call), the call's own device ns and those of the modules
inside it (dotted module paths; a call suffix `#n` is not a path part), 0 where none."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from analysis.analyses.kernel_level import gpu_per_call
from analysis.relations.kernel_rows import COLUMNS, KernelRows

# module calls as the runners name them: nested paths, repeats (`#n`), a name that is a
# string prefix but not a path prefix of another (`ab`), empty parts, a repeated container
CALLS = ["a", "a#1", "a.0", "a.0.conv", "a.0.relu", "a.0.relu#1", "a.0.relu#2", "a.1",
         "a.1.conv#1", "ab", "ab.c", "x..y", "x.", "x", "fc", "b.0.c", "b.0.d"]  # fmt: skip
IDLE = ["idle", "idle.0"]  # calls that run no device work


def _expected(own: pd.DataFrame, layers: pd.DataFrame) -> pd.DataFrame:
    """The pandas rule: own ns per (tkey, layer), summed over the call and the modules in it."""
    summed = own.groupby(["tkey", "layer"], as_index=False)["gpu_ns"].sum(min_count=1)
    rows: list[list[Any]] = []
    for tkey, group in layers.groupby("tkey"):
        have = summed[summed["tkey"] == tkey]
        names = have["layer"].astype(str).to_numpy()
        data = have["gpu_ns"].to_numpy("float64")
        paths = np.array([n.split("#", 1)[0] for n in names], dtype=object)
        for name in group["name"].astype(str).unique():
            base = name.split("#", 1)[0]
            mask = (names == name) | np.array([p.startswith(base + ".") for p in paths], dtype=bool)
            rows.append([int(tkey), name, float(np.nansum(data[mask])) if mask.any() else 0.0])
    gpu = pd.DataFrame(rows, columns=["tkey", "name", "gpu_ns"])
    out = layers.merge(gpu, on=["tkey", "name"], how="left")
    out["gpu_ns"] = out["gpu_ns"].fillna(0.0)
    out["non_gpu_ns"] = out["duration_ns"] - out["gpu_ns"]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_gpu_per_call_sums_each_call_and_the_modules_inside(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_traces, n = 5, 600
    layer = rng.choice([*CALLS, "gone.0", None], n)  # a layer not among the calls, none
    duration = rng.integers(0, 10**9, n).astype("float64")
    duration[layer == "b.0.d"] = np.nan  # a call whose device work has no duration
    kernels = pd.DataFrame({c: pd.Series([None] * n, dtype=object) for c in COLUMNS if c != "row"})
    kernels = kernels.assign(
        tkey=rng.integers(0, n_traces, n),
        layer=layer,
        kind=rng.choice(["kernel", "memcpy", "memset", "runtime", "cpu_op"], n),
        duration_ns=duration,
        metrics_estimated=False,
    )
    layers = pd.DataFrame(
        [
            {"tkey": t, "name": name, "idx": i, "duration_ns": int(rng.integers(0, 2 * 10**9))}
            for t in range(n_traces)
            for i, name in enumerate([*CALLS, *IDLE])
            if rng.random() < 0.8
        ]
    ).assign(original_nodes=None)
    kr = KernelRows.from_frame(kernels)
    kr.add_layers(layers)
    traces = [t for t in range(n_traces) if t != seed % n_traces]  # one trace not compared
    kr.register("compared", pd.DataFrame({"tkey": traces}, dtype="int64"))
    got = kr.query(f"SELECT tkey, name, gpu_ns, non_gpu_ns FROM ({gpu_per_call('compared')})")
    got = got.sort_values(["tkey", "name"]).reset_index(drop=True)
    device = kernels[kernels["kind"].isin(["kernel", "memcpy", "memset"])].dropna(subset="layer")
    own = device.rename(columns={"duration_ns": "gpu_ns"})[["tkey", "layer", "gpu_ns"]]
    want = _expected(own.astype({"gpu_ns": "float64"}), layers[layers["tkey"].isin(traces)])
    want = want.sort_values(["tkey", "name"]).reset_index(drop=True)
    assert got["tkey"].tolist() == want["tkey"].tolist()
    assert got["name"].tolist() == want["name"].tolist()
    for col in ("gpu_ns", "non_gpu_ns"):
        assert got[col].tolist() == want[col].tolist(), col
    assert (got["gpu_ns"] > 0).any() and (got["gpu_ns"] == 0).any()
