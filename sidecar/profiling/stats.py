"""Statistics of a leveled run: XSP's 20% trimmed mean, the representative iteration, A1's
optimal batch size."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

TRIM = 0.2


def trimmed_mean(values: Sequence[int | float], proportion: float = TRIM) -> float:
    """Mean after dropping `proportion` of the values at each end (XSP trims 20%)."""
    if not values:
        raise ValueError("trimmed_mean of no values")
    if not 0.0 <= proportion < 0.5:
        raise ValueError(f"trim proportion must be in [0, 0.5), got {proportion}")
    ordered = sorted(values)
    cut = math.floor(len(ordered) * proportion)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def median(values: Sequence[int | float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2


def representative_index(latencies: Sequence[int | float]) -> int:
    """Index of the iteration whose latency is closest to the median (first one on ties)."""
    med = median(latencies)
    return min(range(len(latencies)), key=lambda i: (abs(latencies[i] - med), i))


def optimal_batch(latency_ns_by_batch: Mapping[int, float], gain: float = 0.05) -> int:
    """XSP A1: the smallest batch size where doubling it raises throughput by at most `gain`.

    Throughput is batch / latency. Batch sizes without a measured double are compared with the
    next larger measured size. If throughput keeps growing, the largest batch is returned.
    """
    if not latency_ns_by_batch:
        raise ValueError("optimal_batch needs at least one batch size")
    sizes = sorted(latency_ns_by_batch)
    throughput = {b: b / latency_ns_by_batch[b] for b in sizes}
    for small, large in itertools.pairwise(sizes):
        if throughput[large] <= throughput[small] * (1.0 + gain):
            return small
    return sizes[-1]
