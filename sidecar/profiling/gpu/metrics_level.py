"""What the hardware-metrics level captured on a GPU, said in the trace (never skipped silently).

XSP's metrics level is one more leveled run. Here its source is Nsight Compute: exact
per-kernel FLOPs by pipe, DRAM bytes and achieved occupancy (`ncu`), imported from its
`--csv` report and joined to the K run's kernels. The K run's trace attributes say which
source gave the numbers, or why there are none:

- `metrics_level`: `captured: ...` or `not captured: <why>`;
- `pm_sampling`: cupti-python 13.4's PM sampling (DRAM and cycle counters every few µs,
  attributable to kernels by time, approximate for short kernels) is not wired in; its
  absence is stated in every GPU trace.

`layer_metric_sums` hangs each layer's summed kernel metrics on the layer span (its own
kernels, by attribution), marked measured with their source.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.profiling.gpu.ncu import NcuKernel, ncu_path
from sidecar.profiling.runners.base import RawSpan

PM_SAMPLING = (
    "not captured: cupti-python PM sampling (13.4; DRAM bytes and cycles every few µs, "
    "attributable to kernels by time, approximate for short kernels) is not wired in"
)
NCU_NOT_ON_PATH = "not captured: ncu not on PATH: metrics level not captured"
NCU_NOT_RUN = (
    "not captured: ncu is on PATH, but the live metrics run is not wired in; profile one "
    "forward with `ncu --csv --metrics ...` and import the CSV (sidecar.profiling.gpu.ncu)"
)
SUMMED = ("flops", "dram_read_bytes", "dram_write_bytes")


def live_status() -> dict[str, str]:
    """Trace attributes of a live GPU profile's K run: why its metrics level is missing."""
    return {
        "metrics_level": NCU_NOT_RUN if ncu_path() else NCU_NOT_ON_PATH,
        "pm_sampling": PM_SAMPLING,
    }


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
        source = span.attributes.get("metrics_source")
        if layer is None or source is None:
            continue
        layers[id(layer)] = layer
        acc = sums.setdefault(id(layer), {"sources": set(), "estimated": False})
        acc["sources"].add(str(source))
        acc["estimated"] |= bool(span.attributes.get("metrics_estimated"))
        for key in SUMMED:
            if (value := span.attributes.get(key)) is not None:
                acc[key] = acc.get(key, 0.0) + float(value)
    for key_id, acc in sums.items():
        attrs = layers[key_id].attributes
        for key in SUMMED:
            if key in acc:
                attrs[f"kernel_{key}"] = acc[key]
        attrs["kernel_metrics_source"] = ", ".join(sorted(acc["sources"]))
        attrs["kernel_metrics_estimated"] = acc["estimated"]
    return len(sums)
