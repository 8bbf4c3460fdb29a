"""`across_traces`' trimmed means are, to the bit, the profiler's `trimmed_mean` of each group
summed in ascending order, also where values tie (its sort of the values need not be stable:
tied values are equal, and -0.0 and 0.0 add alike)."""

from __future__ import annotations

import math
import random

import pandas as pd

from analysis.analyses.common import across_traces
from sidecar.profiling.stats import trimmed_mean


def test_tied_values_give_the_profilers_trimmed_mean_exactly() -> None:
    rng = random.Random(25)
    pool = [0.1, 0.2, 0.3, 0.7, 1e-9, 1e9, 3.0, -0.0, 0.0, math.inf]
    groups = {
        f"g{n}": [rng.choice(pool[:-1] if n % 3 else pool) for _ in range(rng.randint(1, 60))]
        for n in range(40)
    }
    rows = [(g, i, v) for g, vs in groups.items() for i, v in enumerate(vs)]
    rng.shuffle(rows)  # (the rows of a group come in no order)
    out = across_traces(pd.DataFrame(rows, columns=["model", "tkey", "v"]), ["model"], ["v"])
    got = dict(zip(out["model"], out["v"], strict=True))
    assert got.keys() == groups.keys()
    for g, vs in groups.items():
        assert got[g] == trimmed_mean(vs), g  # bit for bit: the same values, the same order
