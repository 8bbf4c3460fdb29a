"""Sampling settings: how many live requests become profiles, and how much CPU they may use."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

DEFAULT_FORCE_HEADER = "x-xsp-profile"


class SamplingSettingsError(ValueError):
    """A sampling setting is out of range."""


@dataclass(frozen=True)
class SamplingSettings:
    """Per-model probability, per-model budget, forcing header and worker duty-cycle cap.

    `rate` is the probability that a request is profiled (default 1 in 1000, Triton's default
    trace rate); `model_rates` overrides it per model. `budget_per_minute` is a token bucket per
    model (burst = one minute's budget). `force_header` names the metadata key whose value `1`
    forces sampling (skipping the rate, not the budget or the duty cycle); `None` disables it.
    `duty_cycle` caps the fraction of wall time the profiling worker may be busy.
    """

    rate: float = 0.001
    model_rates: dict[str, float] = field(default_factory=dict)
    budget_per_minute: float = 6.0
    force_header: str | None = DEFAULT_FORCE_HEADER
    duty_cycle: float = 0.05
    enabled: bool = True

    def __post_init__(self) -> None:
        for name, rate in [("rate", self.rate), *self.model_rates.items()]:
            if not 0.0 <= rate <= 1.0:
                raise SamplingSettingsError(
                    f"sample rate for {name!r} must be in [0, 1], got {rate}"
                )
        if self.budget_per_minute < 0:
            raise SamplingSettingsError(
                f"sample budget must be >= 0 profiles per minute, got {self.budget_per_minute}"
            )
        if not 0.0 < self.duty_cycle <= 1.0:
            raise SamplingSettingsError(f"duty cycle must be in (0, 1], got {self.duty_cycle}")
        if self.force_header is not None and self.force_header != self.force_header.lower():
            raise SamplingSettingsError(
                "the force header must be lowercase (gRPC metadata keys are)"
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
