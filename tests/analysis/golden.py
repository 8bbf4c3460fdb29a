"""The report's outputs on the checked-in stores, locked as golden files under
tests/data/golden/: every analysis (`report.py --format json`, one file per section) of each
store and of a damaged copy, filtered reports, and the rows `export-parquet` writes.

`test_golden.py` compares today's outputs with them, so that a change of engine underneath
(how the store is read, where the analyses run) cannot change an answer unnoticed. After a
change that is meant to change an answer, regenerate and review the diff:

    python -m tests.analysis.golden --update
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.analysis.helpers import CPU_DB, DATA, ENSEMBLE_DB, GPU_DB, LIVE_DB, REPO

GOLDEN = DATA / "golden"
# name -> (stores, report.py options); stores are paths relative to the repository root
# (the report names its sources) or "damaged" (a damaged copy of the CPU store)
REPORTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cpu": (("cpu",), ()),
    "gpu": (("gpu",), ()),
    "live": (("live",), ()),
    "damaged": (("damaged",), ()),
    "cpu+gpu": (("cpu", "gpu"), ()),
    "gpu-since-batch": (("gpu",), ("--since", "1790020000000000000", "--batch-size", "4,8")),
    "live-model": (("live",), ("--model", "big_cnn")),
    "ensemble": (("ensemble",), ()),
}
EXPORTS = ("cpu", "gpu", "live", "damaged", "ensemble")
STORES = {"cpu": CPU_DB, "gpu": GPU_DB, "live": LIVE_DB, "ensemble": ENSEMBLE_DB}
REL_TOL = 1e-9  # floats may differ in their last bits when sums run in another order


def damage_store(db: Path) -> None:
    """Break rows of a copy of the CPU store the ways `test_report_damaged.py` does: three
    durations (NULL, negative, text), one attribute text that is not JSON, one statistic."""
    conn = sqlite3.connect(db)
    try:
        ids = [
            r[0]
            for r in conn.execute(
                "SELECT s.span_id FROM spans s JOIN traces t USING (trace_id) "
                "WHERE t.batch_size = 1 AND s.level = 'layer' AND s.run_level = 'layer' "
                "AND s.name = 'Relu_0_out_nchwc' ORDER BY s.trace_id"
            )
        ]
        for value, sid in zip((None, -16000, "abc"), ids, strict=False):
            conn.execute("UPDATE spans SET duration_ns = ? WHERE span_id = ?", (value, sid))
        (sid,) = conn.execute(
            "SELECT s.span_id FROM spans s JOIN traces t USING (trace_id) WHERE t.batch_size = 2 "
            "AND s.level = 'layer' AND s.name = 'MaxPool_0' ORDER BY s.trace_id LIMIT 1"
        ).fetchone()
        conn.execute(
            'UPDATE spans SET attributes = \'{"op_type": "MaxPool", oops\' WHERE span_id = ?',
            (sid,),
        )
        conn.execute(
            "UPDATE level_stats SET trimmed_mean_ns = NULL WHERE level = 'layer' AND trace_id = "
            "(SELECT trace_id FROM traces WHERE batch_size = 4 ORDER BY trace_id LIMIT 1)"
        )
        conn.execute("UPDATE traces SET batch_size = 0 WHERE trace_id = "
                     "(SELECT trace_id FROM traces WHERE batch_size = 2 ORDER BY trace_id "
                     "LIMIT 1)")  # fmt: skip
        conn.commit()
    finally:
        conn.close()


@contextlib.contextmanager
def stores() -> Iterator[dict[str, str]]:
    """name -> the path the report is given (relative to the repository root where it can
    be, so that the report's `sources` do not depend on the checkout's place)."""
    with tempfile.TemporaryDirectory(prefix="xsp-golden-") as tmp:
        damaged = Path(tmp) / "damaged.sqlite"
        shutil.copy(CPU_DB, damaged)
        damage_store(damaged)
        paths = {k: str(v.relative_to(REPO)) for k, v in STORES.items()}
        paths["damaged"] = str(damaged)
        yield paths


def _report(args: list[str]) -> dict[str, Any]:
    from analysis import report

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = report.main(args)
    if rc != 0:
        raise RuntimeError(f"report.py {' '.join(args)} failed ({rc}): {err.getvalue()}")
    doc: dict[str, Any] = json.loads(out.getvalue())
    doc["meta"].pop("generated", None)
    return doc


def report_doc(name: str, paths: dict[str, str]) -> dict[str, Any]:
    """The JSON report of golden case `name`, with the damaged store's temporary path named
    `damaged.sqlite`."""
    names, options = REPORTS[name]
    dbs = [paths[n] for n in names]
    with contextlib.chdir(REPO):
        doc = _report([*dbs, "--format", "json", *options])
    text = json.dumps(doc)
    if "damaged" in paths:
        text = text.replace(json.dumps(paths["damaged"])[1:-1], "damaged.sqlite")
    result: dict[str, Any] = json.loads(text)
    return result


def export_rows(name: str, paths: dict[str, str]) -> dict[str, Any]:
    """The rows `export-parquet` writes for one store, per table, in a stable order."""
    import duckdb

    from analysis.fleet import analyses as fleet

    with tempfile.TemporaryDirectory(prefix="xsp-golden-export-") as tmp:
        out = Path(tmp) / "fleet"
        with contextlib.chdir(REPO):
            fleet.export_parquet([paths[name]], out)
        con = duckdb.connect()
        try:
            doc: dict[str, Any] = {}
            for table in fleet.TABLES:
                rel = con.sql(f"SELECT * FROM read_parquet('{out}/{table}/*.parquet')")
                cols = rel.columns
                order = ", ".join(f'"{c}"' for c in cols)
                rows = con.sql(f"SELECT * FROM rel ORDER BY {order}").fetchall()
                doc[table] = {
                    "columns": cols,
                    "types": [str(t) for t in rel.types],
                    "rows": [[_plain(v) for v in r] for r in rows],
                }
        finally:
            con.close()
    text = json.dumps(doc)
    if name == "damaged":
        text = text.replace(json.dumps(paths["damaged"])[1:-1], "damaged.sqlite")
    result: dict[str, Any] = json.loads(text)
    return result


def _plain(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


def golden_files(paths: dict[str, str]) -> dict[Path, Any]:
    """Every golden file's path and content: reports one file per section."""
    files: dict[Path, Any] = {}
    for name in REPORTS:
        for section, value in report_doc(name, paths).items():
            files[GOLDEN / "report" / name / f"{section}.json"] = value
    for name in EXPORTS:
        files[GOLDEN / "export" / f"{name}.json"] = export_rows(name, paths)
    return files


def dump(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True, allow_nan=False) + "\n"


def differences(want: Any, got: Any, where: str = "") -> list[str]:
    """Where two JSON values differ (floats within `REL_TOL`), at most a few."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(want) | set(got)):
            if key not in got or key not in want:
                out.append(f"{where}.{key}: {'missing' if key not in got else 'unexpected'}")
            else:
                out += differences(want[key], got[key], f"{where}.{key}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(got)} items, want {len(want)}"]
        return [d for i, (w, g) in enumerate(zip(want, got, strict=True))
                for d in differences(w, g, f"{where}[{i}]")]  # fmt: skip
    number = isinstance(got, int | float) and not isinstance(got, bool)
    if isinstance(want, float) and number and math.isclose(want, got, rel_tol=REL_TOL):
        return []
    if want == got and type(want) is type(got):
        return []
    return [f"{where}: {got!r}, want {want!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the golden files")
    args = parser.parse_args()
    with stores() as paths:
        files = golden_files(paths)
    changed = 0
    for path, value in files.items():
        text = dump(value)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            changed += 1
            print(f"{'wrote' if args.update else 'differs'}: {path.relative_to(REPO)}")
            if args.update:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
    print(f"{len(files)} golden files, {changed} {'rewritten' if args.update else 'differ'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
