"""An ensemble step's outputs from its own runner, for the steps BLS does not run.

The data flow of an ensemble replay (`runners.ensemble`) runs ONNX and Python steps as a BLS
call does; a TorchScript or SavedModel step is run once, unprofiled, by the runner the replay
already loaded for it, and its outputs are named as Triton's backends name them:

- TorchScript (Triton's PyTorch backend): positional. Inputs and outputs named
  `<name>__<index>` go by their index, others in the order of the step's `config.pbtxt`.
- SavedModel (Triton's TensorFlow backend): by name, the serving signature's own keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sidecar.profiling.formats import ModelFormat
from sidecar.profiling.vocabulary import ProfilingError

RUNNER_FORMATS = (ModelFormat.TORCHSCRIPT, ModelFormat.SAVEDMODEL)  # what this module runs
_INDEXED = re.compile(r"^.*__(\d+)$")


def positional(names: Sequence[str]) -> list[str]:
    """`names` in the order Triton's PyTorch backend passes them: by their `__<index>`
    suffix when every name has one, else as given (the config's order)."""
    found = [_INDEXED.match(n) for n in names]
    if names and all(found):
        return sorted(names, key=lambda n: int(_INDEXED.match(n).group(1)))  # type: ignore[union-attr]
    return list(names)


def ordered_feed(location: Any, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A TorchScript step's inputs in its forward's order (other formats: as given)."""
    if location.format is not ModelFormat.TORCHSCRIPT:
        return dict(feed)
    declared = [t.name for t in location.inputs if t.name in feed]
    names = positional(declared + [n for n in feed if n not in declared])
    return {n: feed[n] for n in names}


def step_outputs(
    location: Any, runner: Any, feed: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Run a TorchScript or SavedModel step once on `feed`; its outputs by name."""
    if location.format is ModelFormat.SAVEDMODEL:
        return dict(runner.outputs(feed))
    if location.format is ModelFormat.TORCHSCRIPT:
        values = runner.outputs(ordered_feed(location, feed))
        names = positional([t.name for t in location.outputs])
        if len(values) < len(names):
            raise ProfilingError(
                f"{location.name}: the TorchScript model returned {len(values)} output(s), "
                f"its config.pbtxt declares {len(names)} ({', '.join(names)})"
            )
        return dict(zip(names, values, strict=False))
    raise ProfilingError(f"{location.name}: {location.format.value} steps run as BLS calls")
