"""The readers' shortcuts for sound rows (`damage.sound_span`, `columnar.all_in_sound_traces`)
say what the full checks say: real SQLite, copies of the checked-in stores."""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
from pathlib import Path

import duckdb

from analysis.fleet import analyses as fleet
from analysis.load import columnar, damage
from tests.analysis.helpers import GPU_DB, q

# spans of every shape the checks tell apart: (start_ns, end_ns, duration_ns, idx)
SPANS = [
    (1, 2, 1, 0),  # sound
    (1, 2, 1, None),  # sound, no idx
    (5, 5, 0, 3),  # sound: zero length
    (1, 2, 1.5, 0),  # sound: a real duration
    (1, 2, damage.MAX_NS, 0),  # sound: the largest duration
    (None, 2, 1, 0),
    ("1", 2, 1, 0),
    (1.0, 2, 1, 0),
    (1, None, 1, 0),
    (1, b"2", 1, 0),
    (3, 2, 1, 0),  # ends before it starts
    (1, 2, None, 0),
    (1, 2, "1", 0),
    (1, 2, -1, 0),
    (1, 2, -0.5, 0),
    (1, 2, damage.MAX_NS + 1, 0),
    (1, 2, 1e300, 0),
    (1, 2, 1, "x"),
    (1, 2, 1, 1.5),
]


def test_sound_span_is_true_exactly_where_no_check_names_a_damage() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute("CREATE TABLE spans (start_ns, end_ns, duration_ns, idx)")
        conn.executemany("INSERT INTO spans VALUES (?, ?, ?, ?)", SPANS)
        checks = [
            damage.integer("s.start_ns"),
            damage.integer("s.end_ns"),
            damage.ordered("s.start_ns", "s.end_ns"),
            *damage.duration("s.duration_ns"),
            damage.integer("s.idx", nullable=True),
        ]
        rows = conn.execute(
            f"SELECT coalesce({damage.sound_span('s')}, 0), "
            f"{damage.bad_expression(checks)} FROM spans s ORDER BY rowid"
        ).fetchall()
    finally:
        conn.close()
    assert [bool(sound) for sound, _ in rows] == [bad is None for _, bad in rows]
    assert sum(bool(sound) for sound, _ in rows) == 5


def _spans(out: Path) -> list[tuple[object, ...]]:
    con = duckdb.connect()
    try:
        return sorted(con.sql(f"SELECT * FROM '{out}/spans/*.parquet'").fetchall(), key=str)
    finally:
        con.close()


def test_spans_outside_sound_traces_are_found_and_left_out(tmp_path: Path) -> None:
    """A sound store skips the per-span trace lookup and exports every span of its ok
    traces; a span of no trace, and the spans of a damaged trace, make the export look each
    span's trace up and leave those spans out."""
    assert columnar.all_in_sound_traces(GPU_DB)
    sound = tmp_path / "sound"
    counts = fleet.export_parquet([GPU_DB], sound)
    (kept,) = q(
        GPU_DB,
        "SELECT count(*) FROM spans WHERE NOT (level = 'kernel' AND kind IN ('runtime', 'driver'))",
    )[0]
    assert counts.spans == kept

    db = tmp_path / "orphans.sqlite"
    shutil.copy(GPU_DB, db)
    conn = sqlite3.connect(db)
    try:
        (damaged,) = conn.execute(
            "SELECT trace_id FROM traces ORDER BY trace_id LIMIT 1"
        ).fetchone()
        conn.execute("UPDATE traces SET batch_size = -1 WHERE trace_id = ?", (damaged,))
        conn.execute(
            "INSERT INTO spans (trace_id, span_id, level, name, kind, start_ns, end_ns, "
            "duration_ns) VALUES ('no-such-trace', 'x1', 'model', 'm', 'model', 1, 2, 1), "
            "(NULL, 'x2', 'model', 'm', 'model', 1, 2, 1)"
        )
        conn.commit()
        (lost,) = conn.execute(
            "SELECT count(*) FROM spans WHERE trace_id = ? AND NOT (level = 'kernel' AND "
            "kind IN ('runtime', 'driver'))",
            (damaged,),
        ).fetchone()
    finally:
        conn.close()
    assert lost > 0
    assert not columnar.all_in_sound_traces(db)
    out = tmp_path / "orphans"
    assert fleet.export_parquet([db], out).spans == kept - lost
    exported = {(r[1], r[2]) for r in _spans(out)}
    assert not any(t == damaged or t in ("no-such-trace", None) for t, _ in exported)


# JSON values an attribute that should be a number may hold, and the number the loader reads
# (numpy's float of the decoded value: numbers, booleans, numeric text), or None
NUMBERS = {
    "1": 1.0, "1.5": 1.5, "-5": -5.0, "1E2": 100.0, "-0": 0.0, "1e400": math.inf,
    "18446744073709551615": 18446744073709551615.0, "true": 1.0, "false": 0.0,
    '"12"': 12.0, '"1e3"': 1000.0, '" 7 "': 7.0, '"1_000"': 1000.0, '"inf"': math.inf,
    '"abc"': None, '""': None, '"true"': None, '"0x10"': None, "[1]": None, '{"a": 1}': None,
}  # fmt: skip


def _python_number(value: object) -> float | None:
    if isinstance(value, bool | int | float):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def test_duck_number_reads_a_json_value_as_numpy_reads_it_decoded() -> None:
    for text, expected in NUMBERS.items():  # the rule, in Python
        assert _python_number(json.loads(text)) == expected, text
    con = duckdb.connect()
    try:
        for text, expected in NUMBERS.items():
            doc = json.dumps({"x": json.loads(text)})
            (got,) = con.execute(
                f"SELECT {columnar.duck_number('v')} FROM "
                "(SELECT json_extract(?, ['$.x'])[1] AS v)",
                [doc],
            ).fetchone()
            assert got == expected, text
        (null,) = con.execute(
            f"SELECT {columnar.duck_number('v')} FROM "
            "(SELECT json_extract('{\"x\": null}', ['$.x'])[1] AS v)"
        ).fetchone()
        assert null is None
    finally:
        con.close()
