"""A roof that fits the working set (issue 22, part 6): each layer is judged against the
bandwidth of the smallest cache level holding its inputs, weights and outputs, and "re-measure
the peak" is said only of a compute roof beaten by a layer larger than the last-level cache."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import sqlite3
from pathlib import Path

import pytest

from analysis.analyses.memory_roof import memory_roof
from analysis.trace_analysis import TraceAnalysis
from sidecar.cli import main as sidecar_main
from sidecar.profiling import peak
from tests.analysis.helpers import CPU_DB
from tests.harness import models

SIZES = {"L1": 32 * 2**10, "L2": 2**20, "L3": 32 * 2**20}
BW = {"L1": 200e9, "L2": 100e9, "L3": 50e9, "DRAM": 20e9}


def test_the_smallest_level_holding_the_working_set_gives_the_roof() -> None:
    assert memory_roof(0, SIZES, BW, 25e9) == ("L1", 200e9)  # a view touches nothing
    assert memory_roof(32 * 2**10, SIZES, BW, 25e9) == ("L1", 200e9)
    assert memory_roof(32 * 2**10 + 1, SIZES, BW, 25e9) == ("L2", 100e9)
    assert memory_roof(20 * 2**20, SIZES, BW, 25e9) == ("L3", 50e9)
    # beyond the last level: the trace's DRAM roof, as before cache roofs existed
    assert memory_roof(33 * 2**20, SIZES, BW, 25e9) == ("DRAM", 25e9)


def test_without_a_working_set_or_cache_roofs_the_roof_is_drams() -> None:
    assert memory_roof(math.nan, SIZES, BW, 25e9) == ("DRAM", 25e9)
    assert memory_roof(1024, None, None, 25e9) == ("DRAM", 25e9)
    assert memory_roof(1024, {}, BW, 25e9) == ("DRAM", 25e9)


def test_a_level_roof_is_never_below_a_larger_levels() -> None:
    slow_l3 = {**BW, "L3": 10e9}  # measured under load, below DRAM's
    assert memory_roof(20 * 2**20, SIZES, slow_l3, 25e9) == ("L3", 25e9)
    slow_l1 = {**BW, "L1": 90e9}  # numpy's call cost can hide L1's speed
    assert memory_roof(1024, SIZES, slow_l1, 25e9) == ("L1", 100e9)
    no_l2 = {k: v for k, v in BW.items() if k != "L2"}  # a level without a roof is skipped
    assert memory_roof(2**19, SIZES, no_l2, 25e9) == ("L3", 50e9)


def _copy(tmp_path: Path, sizes: dict[str, int] | None) -> Path:
    """The checked-in CPU store (real ONNX Runtime profiles of the small CNN, whose Conv+Relu
    layers beat the compute roof measured under load), with cache roofs recorded."""
    db = tmp_path / f"cpu-{len(tmp_path.name)}-{sizes is None}.sqlite"
    shutil.copy(CPU_DB, db)
    if sizes is not None:
        conn = sqlite3.connect(db)
        conn.execute(
            "UPDATE traces SET attributes = json_set(attributes, '$.cache_sizes_bytes', "
            "json(?), '$.peak_cache_bytes_per_s', json(?))",
            (json.dumps(sizes), json.dumps(BW)),
        )
        conn.commit()
        conn.close()
    return db


def _rules(ta: TraceAnalysis) -> set[str]:
    return {f.rule for f in ta.findings()}


def test_a_cache_resident_layer_above_the_compute_roof_is_no_reason_to_remeasure(
    tmp_path: Path,
) -> None:
    before = TraceAnalysis.from_paths([_copy(tmp_path, None)])
    assert "peak_below_achieved" in _rules(before)  # today's verdict without cache roofs
    assert "memory_roof" not in before.result("A14").table.columns

    ta = TraceAnalysis.from_paths([_copy(tmp_path, SIZES)])
    a14 = ta.result("A14")
    table = a14.table
    conv = table[table["type"] == "Conv+Relu"]
    assert (conv["working_set_bytes"] < SIZES["L2"]).all()
    assert set(conv["memory_roof"]) <= {"L1", "L2"}
    assert conv["above_roof"].any()  # still above the compute roof: shown, not hidden
    assert "peak_below_achieved" not in _rules(ta)
    assert not any("re-measure" in n for n in a14.notes)
    (note,) = [n for n in a14.notes if "above the roof of the cache that holds" in n]
    assert "measuring it again would not move them" in note
    # the roof each row was judged against is its level's bandwidth
    for row in table.itertuples():
        if row.memory_roof in BW and row.memory_roof != "DRAM":
            assert row.memory_roof_gbps * 1e9 == BW[row.memory_roof]


def test_a_layer_beyond_the_last_level_cache_beating_the_compute_roof_asks_to_remeasure(
    tmp_path: Path,
) -> None:
    tiny = {"L1": 256, "L2": 512, "L3": 1024}  # every layer's working set exceeds them
    ta = TraceAnalysis.from_paths([_copy(tmp_path, tiny)])
    table = ta.result("A14").table
    conv = table[table["type"] == "Conv+Relu"]
    assert (conv["memory_roof"] == "DRAM").all()
    (f,) = [x for x in ta.findings() if x.rule == "peak_below_achieved"]
    assert "Conv+Relu" in f.evidence and "--refresh-peak" in f.action


def test_a_layer_beyond_the_caches_above_the_dram_roof_is_no_reason_to_remeasure(
    tmp_path: Path,
) -> None:
    db = _copy(tmp_path, {"L1": 16, "L2": 32, "L3": 64})  # smaller than every layer's
    conn = sqlite3.connect(db)  # no layer near the FLOP roof, every one above the DRAM roof
    conn.execute(
        "UPDATE traces SET attributes = json_set(attributes, '$.peak_flops_per_s', 1e15, "
        "'$.peak_dram_bytes_per_s', 1e6)"
    )
    conn.commit()
    conn.close()
    ta = TraceAnalysis.from_paths([db])
    a14 = ta.result("A14")
    moved = a14.table[a14.table["flops"] > 0]
    assert (moved["memory_roof"] == "DRAM").all() and moved["above_roof"].all()
    assert (moved["bound"] == "memory").all()
    assert "peak_below_achieved" not in _rules(ta)
    (note,) = [n for n in a14.notes if "above the DRAM roof on its memory side" in n]
    assert f"{len(moved)} layers" in note


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small CNN (tiny convs: every layer's tensors fit in this machine's caches),
    profiled for real on the CPU by ONNX Runtime, its peak from the cache directory."""
    tmp = tmp_path_factory.mktemp("roof")
    cache = tmp / "cache"
    cache.mkdir()
    # FAKE: a cached peak whose DRAM roof (1 MB/s) every layer beats and whose FLOP roof
    # (1 PFLOP/s) none does, whatever this machine's load; it has no cache roofs, so the
    # profile measures this machine's (real) and records them beside it.
    fake = peak.Peak(1e15, 1e6, "cpu-microbenchmark", peak.machine_key(), 1, 0.0, 5)
    (cache / "peak.json").write_text(json.dumps(fake.__dict__))
    model = models.save_onnx(models.small_cnn_onnx(), tmp / "small_cnn.onnx")
    db = tmp / "t.db"
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        mp.setenv("XSP_CACHE_DIR", str(cache))
        mp.setattr(peak, "load_per_cpu", lambda: 0.0)  # read the cached peak as it is
        rc = sidecar_main(["profile", str(model), "--levels", "M,L", "--db", str(db),
                           "--iterations", "6", "--warmup", "2"])  # fmt: skip
    assert rc == 0
    return db


def test_cache_resident_layers_of_a_real_profile_are_within_their_roof(replayed: Path) -> None:
    ta = TraceAnalysis.from_paths([replayed])
    (attrs,) = ta.data.traces["attributes"]
    assert attrs["peak_dram_bytes_per_s"] == 1e6 and "L1" in attrs["peak_cache_bytes_per_s"]
    table = ta.result("A14").table
    known = table[table["working_set_bytes"].notna()]
    assert len(known) == len(table) >= 6
    assert (known["memory_roof"] != "DRAM").all(), known[["name", "working_set_bytes"]]
    moved = known[known["flops"] > 0]
    assert (moved["arithmetic_throughput_gflops"] > moved["arithmetic_intensity"] * 1e-3).all()
    assert not table["above_roof"].any()  # above the DRAM roof, within each one's cache roof
    assert "peak_below_achieved" not in _rules(ta)
    assert not any("re-measure" in n for n in ta.result("A14").notes)
    a15 = ta.result("A15")  # the whole model: above the DRAM roof, on its memory side
    assert a15.table["above_roof"].all() and (a15.table["bound"] == "memory").all()
    assert not any("re-measure" in n for n in a15.notes), a15.notes
    assert any("the peak is not what is wrong" in n for n in a15.notes), a15.notes


def test_the_same_profile_without_cache_roofs_reads_as_before(
    replayed: Path, tmp_path: Path
) -> None:
    db = tmp_path / "old.sqlite"
    shutil.copy(replayed, db)
    conn = sqlite3.connect(db)
    conn.execute(
        "UPDATE traces SET attributes = json_remove(attributes, '$.cache_sizes_bytes', "
        "'$.peak_cache_bytes_per_s', '$.peak_cache_source')"
    )
    conn.commit()
    conn.close()
    ta = TraceAnalysis.from_paths([db])
    assert ta.result("A14").table["above_roof"].any()
    (f,) = [x for x in ta.findings() if x.rule == "peak_below_achieved"]
    assert "--refresh-peak" in f.action
    assert any("re-measure" in n for n in ta.result("A15").notes)


def test_the_html_roofline_draws_the_recorded_cache_roofs(replayed: Path) -> None:
    from analysis.render.html import _cache_roofs, plot_roofline

    a14 = TraceAnalysis.from_paths([replayed]).result("A14")
    (attrs,) = TraceAnalysis.from_paths([replayed]).data.traces["attributes"]
    drawn = _cache_roofs(a14, a14.table)
    assert drawn == {k: v for k, v in attrs["peak_cache_bytes_per_s"].items() if k != "DRAM"}
    assert len(plot_roofline(a14)) == 1
