"""`analysis.analyses.common.across_traces` in SQL: trimmed means over the traces of each group, run
by DuckDB over the kernel relation (`analysis.relations.kernel_rows`), so that the per-span values
stay out of pandas. Only the per-group result comes back as a DataFrame.

The rules are `across_traces`' (and `sidecar.profiling.stats.trimmed_mean`'s):

- groups by `keys`, numbered (and returned) in the keys' sorted order, a missing key value
  after every other value of that key (`analysis.analyses.group_ids`; strings in code point order,
  which DuckDB's byte order of UTF-8 is);
- `n_traces`: how many distinct traces (`tkey`) a group's rows come from;
- per value column: the mean of the group's non-missing values (NULL or NaN) left after
  cutting `k = floor(TRIM * n)` of them from each end (`n`: how many there are), NaN where
  none is;
- `first` columns: those of the group's first row (smallest `row`), missing values included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from analysis.relations.kernel_rows import KernelRows
from sidecar.profiling.stats import TRIM

PART_ROWS = 200_000  # rows of the source whose groups' values are held at once (a part's)
# key columns whose pandas dtype is fixed whatever their values (`Frames.meta`'s batch size)
_DTYPES = {"batch_size": "Int64"}


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def across_traces_sql(
    kr: KernelRows,
    source_sql: str,
    keys: Sequence[str],
    values: Sequence[str],
    first: Sequence[str] = (),
    where: str | None = None,
    params: Sequence[Any] | dict[str, Any] | None = None,
    proportion: float = TRIM,
) -> pd.DataFrame:
    """Trimmed mean of each column in `values` over the traces in each `keys` group, as
    `across_traces` gives it, computed in SQL.

    `source_sql`: a relation name (`kernels`) or a query over `kr`'s relations with the
    columns `row` (the rows' order, for `first`), `tkey`, `keys`, `values` and `first`;
    `where`: an SQL condition on those columns (the rows taken); `params`: the query's
    parameters. Returns one row per group, in key order: the `keys`, the `first` columns,
    `n_traces` (int64) and the `values` (float64); string columns as categoricals with
    their values sorted (as the loader codes strings), `batch_size` as `Int64`.
    """
    keys, values, first = list(keys), list(values), list(first)
    source = source_sql.strip()
    source = source if source.isidentifier() else f"({source})"
    labels = list(dict.fromkeys(["row", "tkey", *keys, *first]))
    # each value as a DOUBLE, NaN as missing (`across_traces` leaves NaN out)
    taken = [
        *map(_q, labels),
        *(
            f"CASE WHEN isnan(CAST({_q(v)} AS DOUBLE)) THEN NULL ELSE CAST({_q(v)} AS DOUBLE) "
            f"END AS _v{i}"
            for i, v in enumerate(values)
        ),
    ]
    # per group: its traces (distinct `tkey`s), the first row's `first` columns (in a struct,
    # so that a missing value is taken too), each value column's non-missing values (a list:
    # a value per trace, or a few) and their least and greatest
    per_group = [
        *map(_q, keys),
        *(f'arg_min(struct_pack(v := {_q(c)}), "row").v AS {_q(c)}' for c in first),
        "list_unique(list(tkey)) AS n_traces",
        *(
            f"list(_v{i}) FILTER (WHERE _v{i} IS NOT NULL) AS _l{i}, min(_v{i}) AS _lo{i}, "
            f"max(_v{i}) AS _hi{i}"
            for i in range(len(values))
        ),
    ]
    # the trimmed mean: the values sorted (a list of equal values is), from the k + 1-th to
    # the (n - k)-th, summed in that order as `across_traces` sums them
    cut = f"{float(proportion)!r}::DOUBLE"
    sort = [
        f"CASE WHEN _lo{i} = _hi{i} THEN _l{i} ELSE list_sort(_l{i}, 'ASC') END"
        for i in range(len(values))
    ]
    means = [
        f"list_avg(list_slice(_s{i}, CAST(floor({cut} * len(_s{i})) AS BIGINT) + 1, "
        f"len(_s{i}) - CAST(floor({cut} * len(_s{i})) AS BIGINT))) AS {_q(v)}"
        for i, v in enumerate(values)
    ]
    order = ", ".join(f"{_q(k)} ASC NULLS LAST" for k in keys)
    src = f"SELECT {', '.join(taken)} FROM {source} AS _source {f'WHERE {where}' if where else ''}"
    # the groups' value lists are held in memory, all at once: a large source is taken in
    # parts, each a share of the groups (by the hash of their keys), so that what is held
    # stays a part's, whatever the store's size
    rows = int(kr.scalar(f"SELECT count(*) FROM ({src})", params) or 0) if keys else 0
    parts = max(1, -(-rows // PART_ROWS))
    if parts > 1:  # its rows made once, not once per part
        kr.execute(f"CREATE OR REPLACE TEMP TABLE _trimmed_source AS {src}", params)
        src, params = "SELECT * FROM _trimmed_source", None
    outs = []
    for part in range(parts):
        mine = f"WHERE hash({', '.join(map(_q, keys))}) % {parts} = {part}" if parts > 1 else ""
        sql = f"""
            WITH src AS ({src}), groups AS (
                SELECT {", ".join(per_group)} FROM src {mine}
                {f"GROUP BY {', '.join(map(_q, keys))}" if keys else "HAVING count(*) > 0"}
            ), sorted AS (
                SELECT *{"".join(f", {e} AS _s{i}" for i, e in enumerate(sort))} FROM groups
            )
            SELECT {", ".join([*map(_q, keys), *map(_q, first), "n_traces", *means])}
            FROM sorted {f"ORDER BY {order}" if keys and parts == 1 else ""}
        """
        outs.append(kr.query(sql, params))
    if parts > 1:
        kr.execute("DROP TABLE _trimmed_source")
    out = outs[0] if parts == 1 else _in_key_order(kr, pd.concat(outs, ignore_index=True), order)
    return _typed(out, [*keys, *first], values)


def _in_key_order(kr: KernelRows, out: pd.DataFrame, order: str) -> pd.DataFrame:
    """The parts' groups put in key order as one query would order them (DuckDB's)."""
    kr.register("_trimmed_parts", out)
    try:
        return kr.query(f"SELECT * FROM _trimmed_parts ORDER BY {order}")
    finally:
        kr.unregister("_trimmed_parts")


def _typed(out: pd.DataFrame, labels: list[str], values: list[str]) -> pd.DataFrame:
    out["n_traces"] = out["n_traces"].astype("int64")
    for col in values:
        out[col] = out[col].astype("float64")
    for col in labels:
        if col in _DTYPES:
            out[col] = out[col].astype(_DTYPES[col])
        elif out[col].dtype == object:
            strings = out[col].dropna()
            if strings.map(type).eq(str).all():
                categories = sorted(strings.unique())
                out[col] = pd.Categorical(out[col], categories=categories)
    return out
