"""Sampling settings: how many live requests become profiles, and how much CPU they may use."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

DEFAULT_FORCE_HEADER = "x-xsp-profile"
# A smaller duty cycle would close the worker's gate for days after one profile.
MIN_DUTY_CYCLE = 0.001
MAX_MODEL_RATES = 1000
MAX_NAME_LENGTH = 256
_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")
ROLLING_P99: Final = "p99"
SLOW_OFF: Final = "off"

# `sample_slow`: off, a fixed latency in milliseconds, or the model's rolling p99.
SlowSetting = float | Literal["off", "p99"]


class SamplingSettingsError(ValueError):
    """A sampling setting is out of range."""


@dataclass(frozen=True)
class SamplingSettings:
    """Per-model probability, per-model budget, forcing header and worker duty-cycle cap.

    `rate` is the probability that a request is profiled (default 1 in 1000, Triton's default
    trace rate); `model_rates` overrides it per model. `budget_per_minute` is a token bucket per
    model (burst = one minute's budget). `force_header` names the metadata key whose value `1`
    forces sampling (skipping the rate, not the budget or the duty cycle); `None` disables it.
    `duty_cycle` caps the fraction of wall time the profiling worker may be busy. `slow`
    profiles requests the rate did not pick whose response came slower than a threshold:
    `"off"`, a latency in milliseconds, or `"p99"` (the model's rolling p99, `slow.py`).
    """

    rate: float = 0.001
    model_rates: dict[str, float] = field(default_factory=dict)
    budget_per_minute: float = 6.0
    force_header: str | None = DEFAULT_FORCE_HEADER
    duty_cycle: float = 0.05
    enabled: bool = True
    slow: SlowSetting = SLOW_OFF

    def __post_init__(self) -> None:
        slow = self.slow
        if slow not in (SLOW_OFF, ROLLING_P99) and not (
            isinstance(slow, int | float) and not isinstance(slow, bool) and 0 < slow < math.inf
        ):
            raise SamplingSettingsError(
                f"sample_slow must be 'off', 'p99' or a latency in milliseconds > 0, got {slow!r}"
            )
        if len(self.model_rates) > MAX_MODEL_RATES:
            raise SamplingSettingsError(
                f"at most {MAX_MODEL_RATES} per-model rates, got {len(self.model_rates)}"
            )
        for model in self.model_rates:
            check_name(model, "model name in model_rates")
        for name, rate in [("rate", self.rate), *self.model_rates.items()]:
            if not (isinstance(rate, int | float) and 0.0 <= rate <= 1.0):  # NaN fails too
                raise SamplingSettingsError(
                    f"sample rate for {name!r} must be in [0, 1], got {rate}"
                )
        budget = self.budget_per_minute
        if not (isinstance(budget, int | float) and math.isfinite(budget) and budget >= 0):
            raise SamplingSettingsError(
                f"sample budget must be a finite number >= 0 profiles per minute, got {budget}"
            )
        if not (
            isinstance(self.duty_cycle, int | float) and MIN_DUTY_CYCLE <= self.duty_cycle <= 1
        ):
            raise SamplingSettingsError(
                f"duty cycle must be in [{MIN_DUTY_CYCLE}, 1], got {self.duty_cycle}"
            )
        if self.force_header is not None:
            header = self.force_header
            if not header or len(header) > MAX_NAME_LENGTH or not set(header) <= _HEADER_CHARS:
                raise SamplingSettingsError(
                    f"the force header must be a lowercase gRPC metadata key (letters, digits, "
                    f"'-', '_', '.'; at most {MAX_NAME_LENGTH} characters), got {header!r}"
                )
            if header.startswith("grpc-") or header.endswith("-bin"):
                raise SamplingSettingsError(
                    f"the force header {header!r} is reserved by gRPC (grpc-*) or binary (*-bin)"
                )

    def rate_for(self, model: str) -> float:
        return self.model_rates.get(model, self.rate)

    @property
    def max_rate(self) -> float:
        """The highest rate of any model: the probability used before the model is known."""
        return max([self.rate, *self.model_rates.values()])

    def updated(self, **changes: Any) -> SamplingSettings:
        """A copy with `changes` applied and validated."""
        return replace(self, **changes)


def check_name(name: str, what: str) -> str:
    """A model name as sampling settings and the admin API accept it: printable, bounded."""
    if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable():
        raise SamplingSettingsError(
            f"{what} must be 1 to {MAX_NAME_LENGTH} printable characters, got {name[:64]!r}"
            + ("..." if len(name) > 64 else "")
        )
    return name
