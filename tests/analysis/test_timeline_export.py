"""`report.py timeline`: Chrome / Perfetto trace-event JSON for one trace."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.analysis.helpers import GPU_DB, LIVE_DB, REPO, q

SCRIPT = REPO / "analysis" / "report.py"


def export(trace: str, db: Path, out: Path) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "timeline", trace, str(db), "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(out.read_text())


def validate(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the trace-event format (JSON object form) and return the complete events."""
    assert isinstance(doc["traceEvents"], list)
    spans = []
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M")
        assert (
            isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        )
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0
            assert isinstance(e["dur"], int | float) and e["dur"] >= 0
            spans.append(e)
        else:
            assert e["name"] in (
                "process_name", "thread_name", "process_sort_index", "thread_sort_index"
            )  # fmt: skip
    named = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in spans} <= named  # every track has a name
    return spans


def _no_partial_overlap(spans: list[dict[str, Any]]) -> None:
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in spans:
        by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for track in by_track.values():
        track.sort(key=lambda se: (se[0], -se[1]))  # parents before children
        stack: list[float] = []
        for s, end in track:
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-6, "slices on one track must nest"
            stack.append(end)


def test_live_trace_timeline(tmp_path: Path) -> None:
    tid = q(
        LIVE_DB,
        "SELECT trace_id FROM traces t WHERE EXISTS (SELECT 1 FROM spans s WHERE "
        "s.trace_id = t.trace_id AND s.level='server') LIMIT 1",
    )[0][0]
    doc = export(tid[:12], LIVE_DB, tmp_path / "trace.json")
    spans = validate(doc)
    rows = q(
        LIVE_DB,
        "SELECT span_id, level, source, start_ns, end_ns FROM spans WHERE trace_id=?",
        (tid,),
    )
    assert len(spans) == len(rows)
    assert doc["otherData"]["trace_id"] == tid
    t0 = min(r[3] for r in rows)
    by_id = {e["args"]["span_id"]: e for e in spans}
    pid_of: dict[str, set[int]] = defaultdict(set)
    tid_of: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for span_id, level, source, start, end in rows:
        e = by_id[span_id]
        assert abs(e["ts"] - (start - t0) / 1000) < 1e-6  # microseconds
        assert abs(e["dur"] - (end - start) / 1000) < 1e-6
        live = source in ("proxy", "backend")
        pid_of["live" if live else "replay"].add(e["pid"])
        tid_of[level].add((e["pid"], e["tid"]))
    # live and replay spans in separate processes; one track per level
    assert len(pid_of["live"]) == 1 and len(pid_of["replay"]) == 1
    assert pid_of["live"] != pid_of["replay"]
    assert set(tid_of) == {"request", "server", "model", "layer"}
    assert all(len(t) == 1 for t in tid_of.values())
    assert len(set().union(*tid_of.values())) == 4
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs[next(iter(pid_of["live"]))].startswith("live")
    assert procs[next(iter(pid_of["replay"]))].startswith("replay")
    _no_partial_overlap([e for e in spans if e["cat"].startswith(("request", "server"))])


def test_gpu_trace_timeline_separates_streams(tmp_path: Path) -> None:
    tid = q(GPU_DB, "SELECT trace_id FROM traces ORDER BY created_ns LIMIT 1")[0][0]
    spans = validate(export(tid, GPU_DB, tmp_path / "gpu.json"))
    (n,) = q(GPU_DB, "SELECT COUNT(*) FROM spans WHERE trace_id=?", (tid,))[0]
    assert len(spans) == n
    kernels = [e for e in spans if e["cat"].startswith("kernel")]
    host = {e["tid"] for e in kernels if e["args"]["kind"] == "runtime"}
    device = {e["tid"] for e in kernels if e["args"]["kind"] in ("kernel", "memcpy", "memset")}
    assert len(host) == 1 and len(device) == 2 and not host & device  # streams 7 and 8
    assert all("flops" in e["args"] for e in kernels if e["args"]["kind"] == "kernel")


def test_unknown_and_ambiguous_ids(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "timeline", "zzzz", str(GPU_DB)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1 and "no trace 'zzzz'" in res.stderr
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "timeline", "", str(GPU_DB)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1 and "ambiguous" in res.stderr
