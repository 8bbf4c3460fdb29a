from __future__ import annotations

import pytest

from sidecar.profiling.levels import parse_levels
from sidecar.profiling.stats import median, optimal_batch, representative_index, trimmed_mean
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


def test_optimal_batch_is_where_doubling_stops_paying() -> None:
    # throughput: 1 -> 100/s, 2 -> 190/s, 4 -> 300/s, 8 -> 310/s (+3.3%), 16 -> 320/s
    lat = {1: 1 / 100, 2: 2 / 190, 4: 4 / 300, 8: 8 / 310, 16: 16 / 320}
    assert optimal_batch(lat) == 4
    assert optimal_batch({1: 1.0, 2: 1.0}) == 2  # still doubling: largest
    assert optimal_batch({4: 1.0}) == 4


def test_parse_levels() -> None:
    assert parse_levels("K,M") == (Level.MODEL, Level.KERNEL)
    assert parse_levels("model, layer") == (Level.MODEL, Level.LAYER)
    with pytest.raises(ValueError, match="unknown level 'X'"):
        parse_levels("M,X")
    with pytest.raises(ValueError):
        parse_levels("request")
