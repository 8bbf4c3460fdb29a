"""Where a sample the sampler took goes, once its message is read: a live-only trace when no
replay can run its model (`sampled_request.keep_live_only`), the hold when the duty cycle makes
an asked-for or slow one wait (`held.HeldSamples`), else the worker's queue
(`sampled_request.hand_over`)."""

from __future__ import annotations

from typing import Protocol

from sidecar.sampling.held import Held, HeldSamples
from sidecar.sampling.held import Hub as HoldHub
from sidecar.sampling.sampled_request import Sample, hand_over, keep_live_only

# What became of a taken sample: its request span is stored at its stream's end (True), once
# the held sample is queued (`Held`), or never (False: dropped and counted).
Taken = Held | bool


class Hub(HoldHub, Protocol):
    """What taking a sample uses of the relay's `observer.SamplingHub`."""

    held: HeldSamples

    def give_back(self, held: bool) -> None: ...


def take(
    hub: Hub,
    label: str,
    sample: Sample,
    message: bytes,
    reason: str,
    *,
    held: bool = False,
    slowness_s: float = 0.0,
) -> Taken:
    """Route a sample `Sampler.admit` took (`held`: it said to hold it; `slowness_s`: a slow
    one's response duration, its rank in the hold)."""
    why = hub.handler.replayability(sample.model)
    if not why.replayable:
        hub.give_back(held)  # nothing runs: its duty-cycle share is not used
        return keep_live_only(hub, label, sample, reason, why)
    if held:
        entry = Held(label, sample, message, reason, slowness_s)
        return entry if hub.held.hold(entry) else False
    return hand_over(hub, label, sample, message, reason)
