"""Statistics of a leveled run: XSP's 20% trimmed mean, the representative iteration, A1's
optimal batch size (`decide_batch`, shared by `xsp-sidecar profile` and the report)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


GAIN = 0.05  # XSP A1: a doubling that adds at most 5% throughput no longer pays
Z95 = 1.96  # two-sided 95% normal quantile


def trimmed_mean_rse(values: Sequence[int | float], proportion: float = TRIM) -> float | None:
    """Relative standard error of the trimmed mean (Tukey-McLaughlin: the winsorized
    standard deviation over (1 - 2g) sqrt(n)); None with fewer than 3 values."""
    n = len(values)
    if n < 3:
        return None
    ordered = sorted(float(v) for v in values)
    g = math.floor(n * proportion)
    wins = [min(max(v, ordered[g]), ordered[n - 1 - g]) for v in ordered]
    mean_w = sum(wins) / n
    sd_w = math.sqrt(sum((v - mean_w) ** 2 for v in wins) / (n - 1))
    tm = trimmed_mean(ordered, proportion)
    if tm <= 0:
        return None
    return sd_w / ((1 - 2 * proportion) * math.sqrt(n)) / tm


@dataclass(frozen=True)
class Doubling:
    """Throughput gain from batch `small` to `2 * small`, with a 95% interval."""

    small: int
    gain: float
    low: float
    high: float
    verdict: str  # "pays" | "stops" | "unclear"


@dataclass(frozen=True)
class BatchDecision:
    """XSP A1's optimal batch size, decided only where the noise allows it.

    `status` is `decided` (`optimal` set), `not_yet_known` (the doubling that would decide was
    not measured: measure `measure_next`) or `uncertain` (the measurements are too noisy or
    contradict each other: re-measure `measure_next`). `reason` says why in one sentence.
    """

    status: str
    optimal: int | None
    reason: str
    measure_next: tuple[int, ...] = ()
    doublings: tuple[Doubling, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {
            "status": self.status,
            "optimal": self.optimal,
            "reason": self.reason,
            "measure_next": list(self.measure_next),
            "doublings": [d.__dict__ for d in self.doublings],
        }


def pct(x: float) -> str:
    """A relative change as `+3.4%`."""
    return f"{x * 100:+.1f}%"


def decide_batch(
    latency_by_batch: Mapping[int, float],
    rse_by_batch: Mapping[int, float | None] | None = None,
    gain: float = GAIN,
) -> BatchDecision:
    """XSP's rule: the optimal batch size is the smallest b where doubling it to 2b raises
    throughput (b / latency) by at most `gain`. The one implementation used by
    `xsp-sidecar profile` and by the report (A1).

    Noise-aware: `rse_by_batch` gives each latency's relative standard error (see
    `trimmed_mean_rse`); a doubling counts as paying or not only when its 95% interval is on
    one side of `gain`. The walk follows doublings from the smallest batch measured; a
    doubling that was not measured leaves the answer `not_yet_known`. A stop that a larger
    measured batch beats by more than `gain` per doubling (a noisy dip) is `uncertain`.
    Without noise estimates (one sample per batch) no decision is better than `uncertain`.
    """
    sizes = sorted(b for b, lat in latency_by_batch.items() if lat and lat > 0)
    if not sizes:
        raise ValueError("decide_batch needs at least one batch size with a latency")
    rse = dict(rse_by_batch or {})
    noisy = [b for b in sizes if rse.get(b) is None]
    thr = {b: b / latency_by_batch[b] for b in sizes}
    walked: list[Doubling] = []
    b = sizes[0]
    while True:
        if 2 * b not in thr:
            done = ", ".join(f"{d.small}->{2 * d.small}: {pct(d.gain)}" for d in walked)
            why = (
                f"every measured doubling raised throughput by more than {gain:.0%} ({done})"
                if walked
                else f"batch {2 * b} (the double of {b}) was not measured"
            )
            missing = sorted({2 * x for x in sizes if 2 * x not in thr and x >= b} | {2 * b})
            return BatchDecision(
                "not_yet_known",
                None,
                f"{why}; measure batch {2 * b} to decide",
                tuple(missing[:2]),
                tuple(walked),
            )
        r = thr[2 * b] / thr[b]
        spread = math.hypot(rse.get(b) or 0.0, rse.get(2 * b) or 0.0) * Z95
        low, high = r * math.exp(-spread) - 1, r * math.exp(spread) - 1
        verdict = "pays" if low > gain else "stops" if high <= gain else "unclear"
        step = Doubling(b, r - 1, low, high, verdict)
        walked.append(step)
        if verdict == "pays":
            b *= 2
            continue
        if verdict == "unclear":
            return BatchDecision(
                "uncertain",
                None,
                f"doubling {b}->{2 * b} adds {pct(step.gain)} (95% interval "
                f"{pct(low)} to {pct(high)}), too noisy to tell from the {gain:.0%} threshold; "
                "repeat these batch sizes",
                (b, 2 * b),
                tuple(walked),
            )
        break
    # b is where doubling stops paying; a larger batch far above it means a noisy dip.
    for big in sorted(x for x in sizes if x > 2 * b):
        doublings = math.log2(big / b)
        spread = math.hypot(rse.get(b) or 0.0, rse.get(big) or 0.0) * Z95
        if thr[big] / thr[b] * math.exp(-spread) > (1 + gain) ** doublings:
            return BatchDecision(
                "uncertain",
                None,
                f"doubling {b}->{2 * b} adds only {pct(walked[-1].gain)} (95% interval "
                f"{pct(walked[-1].low)} to {pct(walked[-1].high)}), but batch {big} "
                f"gives {pct(thr[big] / thr[b] - 1)} over batch {b}: a noisy dip at "
                f"{2 * b}? repeat batch sizes {b} and {2 * b}",
                (b, 2 * b),
                tuple(walked),
            )
    if noisy:
        return BatchDecision(
            "uncertain",
            b,
            f"doubling {b}->{2 * b} adds {pct(walked[-1].gain)}, but batch sizes "
            f"{', '.join(map(str, noisy))} have a single measurement (no noise estimate); "
            "repeat them before relying on it",
            tuple(noisy),
            tuple(walked),
        )
    return BatchDecision(
        "decided",
        b,
        f"doubling {b}->{2 * b} adds {pct(walked[-1].gain)} throughput (95% interval "
        f"{pct(walked[-1].low)} to {pct(walked[-1].high)}), at most {gain:.0%}",
        (),
        tuple(walked),
    )
