"""The hardware-metrics level on a GPU: XSP's extra leveled run, and what it captured.

XSP's metrics level is one more leveled run. Here its source is Nsight Compute: exact
per-kernel FLOPs by pipe, DRAM bytes and achieved occupancy (`ncu`). Live, after the K run,
`live_metrics_level` runs one forward of the same model in a child process
(`gpu.ncu_child`) under `ncu --profile-from-start off`, reads its CSV and matches its
kernels to every K iteration's kernels by launch order and name (`ncu.match_kernels`: any
disagreement fails the level, never a partial match). A recording imports the CSV instead.
The K run's trace attributes say which source gave the numbers, or why there are none:

- `metrics_level`: `captured: ...` or `not captured: <why>`;
- `metrics_run`: the run's own cost (`wall_s` of the whole Nsight Compute command,
  `forward_ns` of the profiled forward with its kernel replays, and `overhead_ratio` over
  M, set by the experiment through `record_overhead`);
- `pm_sampling`: cupti-python 13.4's PM sampling (DRAM and cycle counters every few µs,
  attributable to kernels by time, approximate for short kernels) is not wired in; its
  absence is stated in every GPU trace.

`layer_metric_sums` hangs each layer's summed kernel metrics on the layer span (its own
kernels, by attribution), marked measured with their source.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.gpu.attribution import kernel_layers
from sidecar.profiling.gpu.ncu import (
    METRICS,
    MetricsNotAvailableError,
    NcuJoinError,
    NcuKernel,
    apply_metrics,
    match_kernels,
    ncu_path,
    run_ncu,
)
from sidecar.profiling.gpu.ncu_child import ChildArgs, child_command
from sidecar.profiling.vocabulary import Iteration, ProfilingError, RawSpan
from sidecar.trace import schema

METRICS_TIMEOUT_S = 900.0  # kernel replay is ~100x a forward, plus start-up and warm-up

PM_SAMPLING = (
    "not captured: cupti-python PM sampling (13.4; DRAM bytes and cycles every few µs, "
    "attributable to kernels by time, approximate for short kernels) is not wired in"
)
NCU_NOT_ON_PATH = "not captured: ncu not on PATH: metrics level not captured"
NCU_NOT_REQUESTED = (
    "not captured: the Nsight Compute metrics level was not requested (profile --ncu-metrics)"
)
NCU_FAILED = "not captured: the Nsight Compute run failed: "
SUMMED = (schema.FLOPS, schema.DRAM_READ_BYTES, schema.DRAM_WRITE_BYTES)


def level_status(metrics_level: str) -> dict[str, str]:
    """Trace attributes saying what a live GPU profile's metrics level captured (or why not),
    and that PM sampling is not captured."""
    return {"metrics_level": metrics_level, "pm_sampling": PM_SAMPLING}


def live_status() -> dict[str, str]:
    """Trace attributes of a live GPU profile's K run when `ncu` is not on PATH."""
    return level_status(NCU_NOT_ON_PATH)


def not_requested_status() -> dict[str, str]:
    """Trace attributes of a live GPU profile's K run when the metrics level was not asked for
    (it runs the model again under `ncu`, which can take minutes: never by default)."""
    return level_status(NCU_NOT_REQUESTED)


@dataclass(frozen=True)
class ModelSource:
    """What the metrics child loads: a file (`kind` `torchscript` or `module`, an
    `nn.Module` saved whole), or an in-memory `model` saved to a file first."""

    path: Path | None = None
    kind: str = "torchscript"
    model: Any = None


def live_metrics_level(
    source: ModelSource,
    inputs: Mapping[str, np.ndarray],
    device: str,
    iterations: Sequence[Iteration],
    *,
    warmup: int = 1,
    timeout_s: float = METRICS_TIMEOUT_S,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Run the metrics level for a live K run and hang its metrics on the K iterations'
    kernel spans (and their sums on the layer spans); returns the trace attributes that say
    what was captured, or why not (then no span is touched)."""
    tool = ncu_path()
    if tool is None:
        return live_status()
    try:
        with tempfile.TemporaryDirectory(prefix="xsp-ncu-") as tmp:
            args = _child_args(source, inputs, device, warmup, Path(tmp))
            argv = child_command(python, args)
            profiled, wall_s = run_ncu(argv, timeout_s=timeout_s, env=_child_env())
            result = _read_result(args.result)
        pairs = [match_kernels(it.spans, profiled) for it in iterations]
    except (ProfilingError, NcuJoinError, MetricsNotAvailableError) as exc:
        return level_status(NCU_FAILED + str(exc))
    for it, its_pairs in zip(iterations, pairs, strict=True):
        apply_metrics(its_pairs)
        layer_metric_sums(kernel_layers(it.spans), it.spans)
    return {
        **level_status(
            f"captured: Nsight Compute (ncu, live), {len(profiled)} kernels of one forward"
        ),
        schema.METRICS_RUN: {
            "source": "ncu",
            "kernels": len(profiled),
            "metrics": list(METRICS),
            "wall_s": round(wall_s, 3),
            "forward_ns": int(result["forward_ns"]),
            "warmup": warmup,
            "note": "Nsight Compute profiled one forward in a child process; its metrics are "
            "joined to the kernels of every K iteration in launch order",
        },
    }


def record_overhead(attributes: dict[str, Any], model_ns: float) -> None:
    """`metrics_run.overhead_ratio`: the profiled forward under Nsight Compute (its kernel
    replays included) over M's trimmed mean, as the other levels' overhead."""
    run = attributes.get(schema.METRICS_RUN)
    if isinstance(run, dict) and run.get("forward_ns") and model_ns > 0:
        run["overhead_ratio"] = float(run["forward_ns"]) / model_ns


def _child_args(
    source: ModelSource, inputs: Mapping[str, np.ndarray], device: str, warmup: int, tmp: Path
) -> ChildArgs:
    """Write what the child needs into `tmp`: the model (when only in memory), the inputs."""
    path, kind = source.path, source.kind
    if path is None:
        path, kind = tmp / "model.pt", _save_model(source.model, tmp / "model.pt")
    arrays = [np.ascontiguousarray(a) for a in inputs.values()]
    np.savez(tmp / "inputs.npz", *arrays)
    batch = int(arrays[0].shape[0]) if arrays and arrays[0].ndim else None
    return ChildArgs(
        path, device, tmp / "inputs.npz", tmp / "result.json", kind, max(warmup, 1), batch
    )


def _save_model(model: Any, path: Path) -> str:
    import torch

    if isinstance(model, torch.jit.ScriptModule):
        torch.jit.save(model, str(path))
        return "torchscript"
    try:
        torch.save(model, str(path))
    except Exception as exc:  # pickling: a class defined in a function or in __main__
        raise ProfilingError(
            f"the model cannot be saved for the metrics child ({exc}); define its class at "
            "module level or profile a TorchScript file"
        ) from None
    return "module"


def _child_env() -> dict[str, str]:
    """The child imports this package from where the parent did."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _read_result(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text())
        int(result["forward_ns"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ProfilingError(f"the metrics child left no result ({exc})") from None
    return dict(result)


def recorded_status(ncu: Sequence[NcuKernel] | None) -> dict[str, str]:
    """Trace attributes of a recording's K run: the imported Nsight Compute CSV, or none."""
    level = (
        f"captured: Nsight Compute (ncu --csv), {len(ncu)} kernels of one forward"
        if ncu is not None
        else "not captured: no Nsight Compute CSV was given with the recording"
    )
    return {"metrics_level": level, "pm_sampling": PM_SAMPLING}


def layer_metric_sums(owner: dict[int, RawSpan | None], spans: Sequence[RawSpan]) -> int:
    """Sum the measured metrics of each layer's own kernels onto the layer span as
    `kernel_flops`, `kernel_dram_read_bytes`, `kernel_dram_write_bytes` (with
    `kernel_metrics_source`, `kernel_metrics_estimated`); returns the layers given sums."""
    sums: dict[int, dict[str, Any]] = {}
    layers: dict[int, RawSpan] = {}
    for span in spans:
        layer = owner.get(id(span))
        source = span.attributes.get(schema.METRICS_SOURCE)
        if layer is None or source is None:
            continue
        layers[id(layer)] = layer
        acc = sums.setdefault(id(layer), {"sources": set(), "estimated": False})
        acc["sources"].add(str(source))
        acc["estimated"] |= bool(span.attributes.get(schema.METRICS_ESTIMATED))
        for key in SUMMED:
            if (value := span.attributes.get(key)) is not None:
                acc[key] = acc.get(key, 0.0) + float(value)
    for key_id, acc in sums.items():
        attrs = layers[key_id].attributes
        for key in SUMMED:
            if key in acc:
                attrs[f"kernel_{key}"] = acc[key]
        attrs[schema.KERNEL_METRICS_SOURCE] = ", ".join(sorted(acc["sources"]))
        attrs[schema.KERNEL_METRICS_ESTIMATED] = acc["estimated"]
    return len(sums)
