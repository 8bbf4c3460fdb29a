"""`--sample-slow`: which responses count as slow, per model.

The threshold is fixed (milliseconds) or the model's rolling p99 from `RollingQuantile`: a
histogram of durations in logarithmic buckets (each 2^(1/8), about 9 %, wider than the last,
from 10 us to 10 minutes) over the model's last one to two windows of `window` responses. It
gives no threshold before `min_count` responses of the model (100 by default), so the first
requests after start-up are never "slow". The quantile is recomputed every `refresh`
responses, so one response costs a logarithm, an increment and a comparison.

No lock: the relay calls this from its event loop. A count lost to a race between threads
would only nudge the estimate.
"""

from __future__ import annotations

import math

from sidecar.sampling.settings import ROLLING_P99, SLOW_OFF, SlowSetting

MIN_SECONDS = 1e-5
MAX_SECONDS = 600.0
_LOG_RATIO = math.log(2.0) / 8
N_BUCKETS = math.ceil(math.log(MAX_SECONDS / MIN_SECONDS) / _LOG_RATIO) + 1
# The upper edge of each bucket: a duration is in bucket i when it is at most EDGES[i].
EDGES = tuple(MIN_SECONDS * math.exp(_LOG_RATIO * i) for i in range(N_BUCKETS))

DEFAULT_WINDOW = 1000
DEFAULT_MIN_COUNT = 100
DEFAULT_REFRESH = 50


def bucket_of(seconds: float) -> int:
    """The histogram bucket of a duration (the first or last for ones out of range)."""
    if seconds <= MIN_SECONDS:
        return 0
    return min(N_BUCKETS - 1, math.ceil(math.log(seconds / MIN_SECONDS) / _LOG_RATIO - 1e-9))


class RollingQuantile:
    """A quantile of the last `window` to 2 * `window` durations, in `EDGES` resolution.

    `value` is the upper edge of the bucket that holds the quantile (at most about 9 % above
    the true one), or None until `min_count` durations were observed.
    """

    __slots__ = (
        "_current",
        "_current_n",
        "_previous",
        "_previous_n",
        "_since_refresh",
        "min_count",
        "quantile",
        "refresh",
        "value",
        "window",
    )  # fmt: skip

    def __init__(
        self,
        quantile: float = 0.99,
        *,
        window: int = DEFAULT_WINDOW,
        min_count: int = DEFAULT_MIN_COUNT,
        refresh: int = DEFAULT_REFRESH,
    ) -> None:
        if not 0.0 < quantile < 1.0 or window < 1 or min_count < 1 or refresh < 1:
            raise ValueError("quantile in (0, 1); window, min_count and refresh at least 1")
        self.quantile = quantile
        self.window = window
        self.min_count = min_count
        self.refresh = refresh
        self.value: float | None = None
        self._current = [0] * N_BUCKETS
        self._previous = [0] * N_BUCKETS
        self._current_n = 0
        self._previous_n = 0
        self._since_refresh = 0

    @property
    def count(self) -> int:
        """Durations the estimate is made of now."""
        return self._current_n + self._previous_n

    def observe(self, seconds: float) -> None:
        self._current[bucket_of(seconds)] += 1
        self._current_n += 1
        if self._current_n >= self.window:  # the older window is forgotten
            self._previous, self._current = self._current, [0] * N_BUCKETS
            self._previous_n, self._current_n = self._current_n, 0
        self._since_refresh += 1
        if self._since_refresh >= self.refresh or (
            self.value is None and self.count >= self.min_count
        ):
            self._recompute()

    def _recompute(self) -> None:
        self._since_refresh = 0
        total = self.count
        if total < self.min_count:
            self.value = None
            return
        rank = math.ceil(self.quantile * total)  # the rank-th smallest duration
        seen = 0
        for i, (now, before) in enumerate(zip(self._current, self._previous, strict=True)):
            seen += now + before
            if seen >= rank:
                self.value = EDGES[i]
                return


class SlowDetector:
    """Answers "was this response slow?" per model, for one `sample_slow` setting.

    `observe(model, seconds)` judges a response against the threshold as it stands before the
    response is counted, then counts it (for the rolling p99). Models are bounded metric
    labels (the proxy's cap), so the estimators are bounded too.
    """

    def __init__(self, setting: SlowSetting, **estimator: int) -> None:
        if setting == SLOW_OFF:
            raise ValueError("sample_slow is off: no detector")
        self.setting = setting
        self.fixed_s: float | None = None if setting == ROLLING_P99 else float(setting) / 1000.0
        self._estimator = estimator
        self._models: dict[str, RollingQuantile] = {}

    @classmethod
    def of(cls, setting: SlowSetting) -> SlowDetector | None:
        """The detector of a setting; None when it is off."""
        return None if setting == SLOW_OFF else cls(setting)

    def threshold_s(self, model: str) -> float | None:
        """The model's threshold now, in seconds (None: no estimate yet)."""
        if self.fixed_s is not None:
            return self.fixed_s
        estimate = self._models.get(model)
        return estimate.value if estimate is not None else None

    def observe(self, model: str, seconds: float) -> bool:
        fixed = self.fixed_s
        if fixed is not None:
            return seconds > fixed
        estimate = self._models.get(model)
        if estimate is None:
            estimate = self._models[model] = RollingQuantile(**self._estimator)
        threshold = estimate.value
        estimate.observe(seconds)
        return threshold is not None and seconds > threshold
