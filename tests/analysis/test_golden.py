"""Every analysis on the checked-in stores (and a damaged copy), filtered reports and the
Parquet export, the same as the golden files under tests/data/golden/ (see golden.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.analysis import golden


@pytest.fixture(scope="module")
def outputs() -> Iterator[dict[Path, Any]]:
    with golden.stores() as paths:
        yield golden.golden_files(paths)


def _cases() -> list[str]:
    return [*(f"report/{n}" for n in golden.REPORTS), *(f"export/{n}" for n in golden.EXPORTS)]


@pytest.mark.parametrize("case", _cases())
def test_outputs_match_the_golden_files(case: str, outputs: dict[Path, Any]) -> None:
    mine = {p: v for p, v in outputs.items() if p.is_relative_to(golden.GOLDEN / case)
            or p == golden.GOLDEN / f"{case}.json"}  # fmt: skip
    assert mine, case
    stored = {p for p in (golden.GOLDEN / case).glob("*.json") if (golden.GOLDEN / case).is_dir()}
    assert stored <= set(mine), f"sections no longer reported: {sorted(stored - set(mine))}"
    problems = []
    for path, value in sorted(mine.items()):
        if not path.exists():
            problems.append(f"{path.name}: no golden file (python -m tests.analysis.golden)")
            continue
        want = json.loads(path.read_text(encoding="utf-8"))
        diff = golden.differences(want, json.loads(golden.dump(value)))
        problems += [f"{path.relative_to(golden.GOLDEN)}{d}" for d in diff[:5]]
    assert not problems, "\n".join(problems[:30])


def test_the_damaged_store_skips_and_names_its_rows(outputs: dict[Path, Any]) -> None:
    """The golden damaged report itself says what it skipped (the lock is on the right thing)."""
    rows = outputs[golden.GOLDEN / "report" / "damaged" / "skipped_rows.json"]
    reasons = {(r["table"], r["column"], r["reason"].split(" (")[0]) for r in rows["rows"]}
    assert reasons >= {
        ("spans", "duration_ns", "NULL"),
        ("spans", "duration_ns", "negative"),
        ("spans", "duration_ns", "not a number"),
        ("spans", "attributes", "not valid JSON"),
        ("level_stats", "trimmed_mean_ns", "NULL"),
        ("traces", "batch_size", "not a positive integer"),
    }
