"""Exact per-kernel hardware metrics from Nsight Compute (`ncu --csv`), joined to CUPTI kernels.

XSP's metrics level is one more leveled run: the model runs once under a metrics profiler
that replays every kernel (100x slower), and the metrics are hung on the kernels of the K
run. Here the profiler is Nsight Compute: its `--csv` output (one row per kernel and metric)
is read into `NcuKernel`s, turned into span attributes (FLOPs by pipe, DRAM bytes, achieved
occupancy; `metrics_source` = `ncu`), and joined to one forward's CUPTI kernels in launch
order, checking that the names agree.

FLOPs: FP32/FP16/FP64 pipes count `2 * fma + add + mul` thread instructions (measured). The
tensor pipe is counted in warp-level instructions (`sm__inst_executed_pipe_tensor.sum`);
`tensor_flops` converts them at `TENSOR_FLOPS_PER_INST` (an m16n8k8 HMMA, TF32 or FP16:
16*8*8*2 = 2048 FLOPs), which is an assumption about the instruction shape and is stored as
such (`tensor_flops_per_instruction`).
"""

from __future__ import annotations

import csv
import gzip
import io
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.profiling.gpu.demangle import base_name
from sidecar.profiling.runners.base import LevelNotSupportedError, ProfilingError, RawSpan

TENSOR_FLOPS_PER_INST = 2048
METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "sm__sass_thread_inst_executed_op_ffma_pred_on.sum",
    "sm__sass_thread_inst_executed_op_fadd_pred_on.sum",
    "sm__sass_thread_inst_executed_op_fmul_pred_on.sum",
    "sm__sass_thread_inst_executed_op_hfma_pred_on.sum",
    "sm__sass_thread_inst_executed_op_hadd_pred_on.sum",
    "sm__sass_thread_inst_executed_op_hmul_pred_on.sum",
    "sm__sass_thread_inst_executed_op_dfma_pred_on.sum",
    "sm__sass_thread_inst_executed_op_dadd_pred_on.sum",
    "sm__sass_thread_inst_executed_op_dmul_pred_on.sum",
    "sm__inst_executed_pipe_tensor.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)
_PIPES = {"fp32": "f", "fp16": "h", "fp64": "d"}


class MetricsNotAvailableError(LevelNotSupportedError):
    """Hardware metrics cannot be collected here (no `ncu`, no GPU)."""


class NcuJoinError(ProfilingError):
    """Nsight Compute's kernels do not match the CUPTI kernels they should describe."""


@dataclass
class NcuKernel:
    """One profiled kernel: its name as Nsight Compute prints it and its metric values."""

    id: int
    name: str
    block: str = ""
    grid: str = ""
    metrics: dict[str, float] = field(default_factory=dict)

    def value(self, metric: str) -> float | None:
        return self.metrics.get(metric)


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text or text.lower() in ("n/a", "nan"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def read_ncu_csv(source: str | Path) -> list[NcuKernel]:
    """Kernels of an `ncu --csv` report (file, `.gz` file); `==PROF==` lines are skipped."""
    path = Path(source)
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as fh:
        text = fh.read()
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        raise ProfilingError(f"{path}: not an `ncu --csv` report (no header row)")
    kernels: dict[int, NcuKernel] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[head:]))):
        if not row.get("ID", "").strip().isdigit():
            continue
        kid = int(row["ID"])
        k = kernels.setdefault(
            kid,
            NcuKernel(kid, row.get("Kernel Name", ""), row.get("Block Size", ""),
                      row.get("Grid Size", "")),
        )  # fmt: skip
        value = _number(row.get("Metric Value", ""))
        if value is not None:
            k.metrics[row["Metric Name"]] = value
    return [kernels[k] for k in sorted(kernels)]


def kernel_attributes(k: NcuKernel) -> dict[str, Any]:
    """Span attributes of one kernel's metrics (only those measured)."""
    attrs: dict[str, Any] = {"metrics_source": "ncu", "metrics_estimated": False}
    flops = 0.0
    seen = False
    for pipe, p in _PIPES.items():
        fma = k.value(f"sm__sass_thread_inst_executed_op_{p}fma_pred_on.sum")
        add = k.value(f"sm__sass_thread_inst_executed_op_{p}add_pred_on.sum")
        mul = k.value(f"sm__sass_thread_inst_executed_op_{p}mul_pred_on.sum")
        if fma is None and add is None and mul is None:
            continue
        pipe_flops = 2 * (fma or 0.0) + (add or 0.0) + (mul or 0.0)
        attrs[f"flops_{pipe}"] = pipe_flops
        flops += pipe_flops
        seen = True
    tensor = k.value("sm__inst_executed_pipe_tensor.sum")
    if tensor is not None:
        attrs["tensor_pipe_instructions"] = tensor
        attrs["tensor_flops"] = tensor * TENSOR_FLOPS_PER_INST
        attrs["tensor_flops_per_instruction"] = TENSOR_FLOPS_PER_INST
        flops += attrs["tensor_flops"]
        seen = True
    if seen:
        attrs["flops"] = flops
    for metric, key in (
        ("dram__bytes_read.sum", "dram_read_bytes"),
        ("dram__bytes_write.sum", "dram_write_bytes"),
        ("gpu__time_duration.sum", "ncu_duration_ns"),
    ):
        if (v := k.value(metric)) is not None:
            attrs[key] = v
    occ = k.value("sm__warps_active.avg.pct_of_peak_sustained_active")
    if occ is not None:
        attrs["achieved_occupancy"] = occ / 100.0
    return attrs


def join_metrics(
    kernels: Sequence[RawSpan], profiled: Sequence[NcuKernel], *, min_name_match: float = 0.95
) -> int:
    """Hang `profiled` metrics on one forward's CUPTI `kernels` (launch order), in place.

    The two lists must have the same length and agree on the kernels' own names (the last
    `::` component, which CUPTI's and Nsight Compute's spellings share) for at least
    `min_name_match` of the pairs; otherwise `NcuJoinError`. Returns the number joined."""
    ks = sorted((s for s in kernels if s.kind == "kernel"), key=lambda s: s.start_ns)
    if len(ks) != len(profiled):
        raise NcuJoinError(
            f"Nsight Compute profiled {len(profiled)} kernels but the forward ran {len(ks)}: "
            "profile exactly one forward (warm-up excluded)"
        )
    same = sum(
        base_name(str(s.attributes.get("mangled_name", s.name))) == base_name(p.name)
        for s, p in zip(ks, profiled, strict=True)
    )
    if ks and same < min_name_match * len(ks):
        raise NcuJoinError(
            f"only {same} of {len(ks)} kernel names agree between CUPTI and Nsight Compute: "
            "the two runs did not execute the same kernels"
        )
    for span, prof in zip(ks, profiled, strict=True):
        span.attributes.update(kernel_attributes(prof))
        span.attributes["ncu_kernel_id"] = prof.id
    return len(ks)


def ncu_path() -> str | None:
    return shutil.which("ncu")


def run_ncu(
    argv: Sequence[str], *, timeout_s: float = 600.0, metrics: Sequence[str] = METRICS
) -> tuple[list[NcuKernel], float]:
    """Run `argv` (a Python command that profiles one forward between
    `torch.cuda.profiler.start()`/`stop()`) under Nsight Compute; return its kernels and the
    wall time of the profiled command (seconds, the metrics run's cost)."""
    tool = ncu_path()
    if tool is None:
        raise MetricsNotAvailableError(
            "hardware metrics not available: Nsight Compute (`ncu`) is not on PATH"
        )
    cmd = [
        tool,
        "--csv",
        "--profile-from-start",
        "off",
        "--target-processes",
        "all",
        "--metrics",
        ",".join(metrics),
        *argv,
    ]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MetricsNotAvailableError(f"Nsight Compute did not finish: {exc}") from None
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise MetricsNotAvailableError(f"Nsight Compute failed: {' | '.join(tail)}")
    tmp = Path(time.strftime("/tmp/xsp-ncu-%Y%m%d-%H%M%S.csv"))
    tmp.write_text(out.stdout)
    try:
        return read_ncu_csv(tmp), wall
    finally:
        tmp.unlink(missing_ok=True)
