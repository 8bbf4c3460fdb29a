"""A batch sweep's optimal batch size, with the noisy batch sizes measured again.

`sweep_decision` applies XSP A1's rule (`stats.decide_batch`) to the M runs of a sweep the way
the report does from the stored traces: each batch size's trimmed mean with the relative
standard error of its samples. `settle` repeats the M run of the batch sizes an `uncertain`
decision names with the runner already loaded, pools the new iterations into those profiles
(`LeveledProfile.pool_model_run`: the noise estimate shrinks) and decides again, at most
`max_rounds` times. It never measures a batch size the sweep did not include: a
`not_yet_known` decision is left for the user (with the batch sizes to add).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sidecar.profiling.experiment import LeveledProfile
from sidecar.profiling.stats import BatchDecision, decide_batch, pct, trimmed_mean_rse
from sidecar.profiling.vocabulary import Runner
from sidecar.trace.spans import Level


def batch_of(result: LeveledProfile) -> int:
    """The batch size a sweep point was measured at (1 when the trace has none)."""
    return result.trace.batch_size or 1


def sweep_decision(results: Sequence[LeveledProfile]) -> BatchDecision | None:
    """XSP A1's optimal batch over a batch sweep (the rule and inputs the report uses too);
    None for fewer than two batch sizes."""
    if len(results) < 2:
        return None
    stats = {batch_of(r): r.stats(Level.MODEL) for r in results}
    return decide_batch(
        {b: s.trimmed_mean_ns for b, s in stats.items()},
        {b: trimmed_mean_rse(s.samples_ns) for b, s in stats.items()},
    )


def _sizes(batches: Sequence[int]) -> str:
    names = [str(b) for b in batches]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


@dataclass(frozen=True)
class Round:
    """One repeat: its number (from 1), the batch sizes measured again and the decision that
    asked for them."""

    number: int
    batches: tuple[int, ...]
    asked_by: BatchDecision

    def describe(self, max_rounds: int) -> str:
        """`re-measuring batch 2 and 4 (round 1 of 2): 95% interval of 2->4 was ...`."""
        head = f"re-measuring batch {_sizes(self.batches)} (round {self.number} of {max_rounds})"
        last = self.asked_by.doublings[-1] if self.asked_by.doublings else None
        if last is None or self.batches != (last.small, 2 * last.small):
            return f"{head}: {self.asked_by.reason}"
        why = (
            f"95% interval of {last.small}->{2 * last.small} was {pct(last.low)} to "
            f"{pct(last.high)}"
        )
        if last.verdict == "stops":  # a larger batch beats the stop: a noisy dip
            why += ", but a larger batch does better (a noisy dip?)"
        return f"{head}: {why}"


@dataclass(frozen=True)
class Settled:
    """The final decision of a sweep and the repeats it took."""

    decision: BatchDecision
    rounds: tuple[Round, ...]
    max_rounds: int

    @property
    def remeasured(self) -> tuple[int, ...]:
        return tuple(sorted({b for r in self.rounds for b in r.batches}))

    def summary(self) -> str:
        """One line: how many extra rounds the decision took, or why it is still open."""
        n = len(self.rounds)
        took = (
            f"after {n} extra round{'s' if n != 1 else ''} (re-measured batch "
            f"{_sizes(self.remeasured)})"
            if n
            else "on the sweep alone (no extra rounds)"
        )
        if self.decision.status == "decided":
            return f"decided {took}"
        if self.decision.status == "not_yet_known":
            return "the sweep lacks the batch sizes that would decide" + (f" ({took})" if n else "")
        if self.max_rounds == 0:
            return "still uncertain: not re-measured (--max-rounds 0)"
        return (
            f"still uncertain {took}, the most --max-rounds {self.max_rounds} allows: raise "
            "--iterations or --max-rounds, or profile on a quieter machine"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "rounds": len(self.rounds),
            "max_rounds": self.max_rounds,
            "remeasured": [list(r.batches) for r in self.rounds],
            "summary": self.summary(),
        }


def settle(
    results: Sequence[LeveledProfile],
    runner: Runner,
    inputs: Callable[[int], Mapping[str, np.ndarray]],
    *,
    iterations: int,
    warmup: int,
    max_rounds: int,
    on_round: Callable[[Round], None] | None = None,
) -> Settled | None:
    """Repeat the M run of the batch sizes an `uncertain` decision names until it is not
    uncertain or `max_rounds` repeats were made; None without a sweep (one batch size).

    `inputs(batch)` gives the model's inputs at a batch size; `on_round` is told about each
    round before it runs. Each re-measured profile gets the new iterations pooled in."""
    if max_rounds < 0:
        raise ValueError(f"max_rounds must be >= 0, got {max_rounds}")
    decision = sweep_decision(results)
    if decision is None:
        return None
    by_batch = {batch_of(r): r for r in results}
    rounds: list[Round] = []
    while decision.status == "uncertain" and len(rounds) < max_rounds:
        batches = tuple(b for b in decision.measure_next if b in by_batch)
        if not batches:
            break
        this = Round(len(rounds) + 1, batches, decision)
        if on_round is not None:
            on_round(this)
        for b in batches:
            by_batch[b].pool_model_run(runner.run(inputs(b), Level.MODEL, iterations, warmup))
        rounds.append(this)
        decision = sweep_decision(results)
        assert decision is not None
    return Settled(decision, tuple(rounds), max_rounds)
