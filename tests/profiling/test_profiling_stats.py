from __future__ import annotations

import pytest

from sidecar.profiling.levels import parse_levels
from sidecar.profiling.stats import (
    decide_batch,
    median,
    representative_index,
    trimmed_mean,
    trimmed_mean_rse,
)
from sidecar.trace.spans import Level


def test_trimmed_mean_drops_20_percent_each_side() -> None:
    values = [1000, 1, 2, 3, 4, 5, 6, 7, 8, -1000]  # 10 values: drop 2 low, 2 high
    assert trimmed_mean(values) == pytest.approx((2 + 3 + 4 + 5 + 6 + 7) / 6)


def test_trimmed_mean_small_samples_and_errors() -> None:
    assert trimmed_mean([5]) == 5
    assert trimmed_mean([1, 100]) == pytest.approx(50.5)  # nothing to trim with 2 values
    with pytest.raises(ValueError):
        trimmed_mean([])


def test_representative_is_closest_to_median() -> None:
    lat = [100, 300, 205, 190, 900]
    assert median(lat) == 205
    assert representative_index(lat) == 2
    assert representative_index([10, 30]) == 0  # tie -> first


QUIET = 0.005  # relative standard error of a well-repeated measurement


def _quiet(lat: dict[int, float]) -> dict[int, float | None]:
    return {b: QUIET for b in lat}


def test_optimal_batch_is_where_doubling_stops_paying() -> None:
    # throughput: 1 -> 100/s, 2 -> 190/s, 4 -> 300/s, 8 -> 310/s (+3.3%), 16 -> 320/s
    lat = {1: 1 / 100, 2: 2 / 190, 4: 4 / 300, 8: 8 / 310, 16: 16 / 320}
    d = decide_batch(lat, _quiet(lat))
    assert (d.status, d.optimal) == ("decided", 4)
    assert [x.verdict for x in d.doublings] == ["pays", "pays", "stops"]
    assert d.doublings[-1].gain == pytest.approx(310 / 300 - 1)


def test_still_doubling_is_not_yet_known() -> None:
    # the sweep: latencies 1.00, 1.05, 1.11, 1.14 ms: every doubling pays
    lat = {1: 1.00, 2: 1.05, 4: 1.11, 8: 1.14}
    d = decide_batch(lat, _quiet(lat))
    assert (d.status, d.optimal, d.measure_next) == ("not_yet_known", None, (16,))
    assert "measure batch 16" in d.reason


def test_unmeasured_double_is_not_yet_known() -> None:
    # `profile --batch-size 1,4`: batch 2 was never measured, so nothing is decided
    lat = {1: 1.0, 4: 1.02}
    d = decide_batch(lat, _quiet(lat))
    assert (d.status, d.optimal) == ("not_yet_known", None)
    assert d.measure_next == (2, 8)


def test_a_noisy_dip_is_not_an_optimum() -> None:
    # the demo's sweep: 49,665 inputs/s at batch 2, a dip at 4, 76,934 at 8
    thr = {1: 25_000.0, 2: 49_665.0, 4: 47_000.0, 8: 76_934.0}
    lat = {b: b / t for b, t in thr.items()}
    d = decide_batch(lat, _quiet(lat))
    assert (d.status, d.optimal) == ("uncertain", None)
    assert d.measure_next == (2, 4) and "batch 8" in d.reason


def test_noise_wider_than_the_threshold_is_uncertain() -> None:
    lat = {1: 1 / 100, 2: 2 / 190, 4: 4 / 300, 8: 8 / 310}
    d = decide_batch(lat, {b: 0.05 for b in lat})  # 5% noise on each point
    assert (d.status, d.optimal, d.measure_next) == ("uncertain", None, (4, 8))
    d = decide_batch(lat)  # one sample each: no noise estimate
    assert (d.status, d.optimal) == ("uncertain", 4)
    assert "single measurement" in d.reason


def test_trimmed_mean_rse() -> None:
    assert trimmed_mean_rse([1.0, 1.0]) is None  # too few to say
    assert trimmed_mean_rse([5.0] * 10) == 0.0
    values = [100.0, 102.0, 98.0, 101.0, 99.0, 250.0, 100.0, 97.0, 103.0, 100.0]
    rse = trimmed_mean_rse(values)
    assert rse is not None and 0.002 < rse < 0.02  # the 250 outlier is winsorized


def test_parse_levels() -> None:
    assert parse_levels("K,M") == (Level.MODEL, Level.KERNEL)
    assert parse_levels("model, layer") == (Level.MODEL, Level.LAYER)
    with pytest.raises(ValueError, match="unknown level 'X'"):
        parse_levels("M,X")
    with pytest.raises(ValueError):
        parse_levels("request")
