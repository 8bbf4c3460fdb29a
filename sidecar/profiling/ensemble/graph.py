"""An ensemble's graph from its `config.pbtxt`: steps, tensor maps and dependency order.

Each step of `ensemble_scheduling` names a model (and version) and maps tensors:
`input_map` {step model's input: ensemble tensor}, `output_map` {step model's output: ensemble
tensor}. A step can run once every ensemble tensor its `input_map` reads exists: an ensemble
input or a tensor an earlier step wrote. `in_order` gives the steps in that order (config
order among the ready ones, as Triton lists them); a step that can never run (a tensor no
one writes, or a cycle) is an `EnsembleGraphError` that names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.profiling.vocabulary import ProfilingError


class EnsembleGraphError(ProfilingError):
    """The ensemble's steps cannot be put in an order that runs them all."""


@dataclass(frozen=True)
class EnsembleStep:
    """One step: its model, the version asked for (-1: latest) and its tensor maps."""

    model: str
    version: int
    input_map: tuple[tuple[str, str], ...]  # (step model's input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (step model's output, ensemble tensor)

    def key(self, ensemble: str) -> str:
        """`<ensemble>/<step model>`: the key per-step analyses join on."""
        return f"{ensemble}/{self.model}"

    def feed(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The step model's inputs, read from the ensemble's tensors through `input_map`."""
        return {inner: tensors[outer] for inner, outer in self.input_map}

    def publish(self, outputs: Mapping[str, np.ndarray], tensors: dict[str, np.ndarray]) -> None:
        """Write the step model's outputs into the ensemble's tensors through `output_map`."""
        for inner, outer in self.output_map:
            if inner not in outputs:
                raise EnsembleGraphError(
                    f"step {self.model!r} gave no output {inner!r} (its output_map needs it; "
                    f"it gave {', '.join(sorted(outputs)) or 'nothing'})"
                )
            tensors[outer] = outputs[inner]


def steps_of(config: Any) -> list[EnsembleStep]:
    """The steps of a parsed ensemble `ModelConfig`, in config order."""
    if config is None or not config.HasField("ensemble_scheduling"):
        raise EnsembleGraphError("the model's config.pbtxt has no ensemble_scheduling")
    steps = [
        EnsembleStep(
            model=s.model_name,
            version=int(s.model_version),
            input_map=tuple(sorted(s.input_map.items())),
            output_map=tuple(sorted(s.output_map.items())),
        )
        for s in config.ensemble_scheduling.step
    ]
    if not steps:
        raise EnsembleGraphError("the ensemble's ensemble_scheduling has no step")
    return steps


def in_order(steps: Iterable[EnsembleStep], inputs: Iterable[str]) -> list[EnsembleStep]:
    """The steps in an order where each one's inputs exist before it runs."""
    pending = list(steps)
    available = set(inputs)
    ordered: list[EnsembleStep] = []
    while pending:
        ready = next((s for s in pending if {o for _, o in s.input_map} <= available), None)
        if ready is None:
            step = pending[0]
            missing = sorted({o for _, o in step.input_map} - available)
            raise EnsembleGraphError(
                f"step {step.model!r} can never run: no ensemble input or earlier step gives "
                f"{', '.join(missing)} (a cycle, or a tensor no step writes)"
            )
        pending.remove(ready)
        ordered.append(ready)
        available |= {o for _, o in ready.output_map}
    return ordered
