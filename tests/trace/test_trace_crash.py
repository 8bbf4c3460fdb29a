"""kill -9 of a process in the middle of writing leaves a readable store of complete traces."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sidecar.trace.store import TraceStore

REPO = Path(__file__).resolve().parents[2]

# The child writes traces of random sizes forever, through the writer thread or directly.
CHILD = textwrap.dedent(
    """
    import random, sys
    from sidecar.trace.store import TraceStore
    from sidecar.trace.writer import TraceWriter
    from tests.harness.traces.synthetic import make_trace

    path, mode = sys.argv[1], sys.argv[2]
    rng = random.Random()
    sink = TraceWriter(path, batch_max=4) if mode == "writer" else TraceStore(path)
    while True:
        parts = make_trace(layers=rng.randint(5, 60), kernels_per_layer=rng.randint(1, 4),
                           pad=rng.randint(0, 300))
        if mode == "writer":
            sink.submit(*parts)
            sink.flush()
        else:
            sink.write_trace(*parts)
    """
)


def _committed(path: Path) -> int:
    if not path.exists():
        return 0
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute("SELECT COUNT(*) FROM traces").fetchone()[0]
    except sqlite3.OperationalError:  # not migrated yet
        return 0
    finally:
        conn.close()


@pytest.mark.parametrize("mode", ["writer", "direct"])
def test_kill_9_mid_write_leaves_only_complete_traces(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "traces.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    total_kills = 3
    for round_ in range(total_kills):
        before = _committed(path)
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], env=env, cwd=REPO)
        try:
            deadline = time.monotonic() + 30
            while _committed(path) < before + 5:  # let it get well into writing
                assert child.poll() is None, f"writer child exited with {child.returncode}"
                assert time.monotonic() < deadline, "child wrote nothing in 30 s"
                time.sleep(0.02)
            time.sleep(random.uniform(0, 0.05))  # land somewhere inside a write
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert child.returncode == -signal.SIGKILL, round_

    with TraceStore(path) as store:  # reopening recovers from the WAL
        conn = store.db.conn
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        traces = store.list_traces(limit=10_000)
        assert len(traces) >= 5 * total_kills
        for trace in traces:
            assert len(store.spans(trace.trace_id)) == trace.attributes["span_count"]
            assert len(store.level_stats(trace.trace_id)) == trace.attributes["stats_count"]
        orphans = conn.execute(
            "SELECT COUNT(*) FROM spans WHERE trace_id NOT IN (SELECT trace_id FROM traces)"
        ).fetchone()[0]
        assert orphans == 0  # no span of a trace whose row did not commit
