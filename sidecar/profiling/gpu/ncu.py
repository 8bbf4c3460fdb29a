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
such (`tensor_flops_per_instruction`). It does not hold for Hopper's warpgroup MMAs: the H100
ResNet-50 b8 recording converts to 44.7 GFLOP against ~65 GFLOP of convolution work. So a
kernel whose FLOPs include converted tensor instructions is `metrics_estimated` (with
`estimated_because`); its DRAM bytes, time and occupancy are still Nsight Compute's.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.profiling.gpu.demangle import base_name
from sidecar.profiling.vocabulary import LevelNotSupportedError, ProfilingError, RawSpan
from sidecar.trace import schema

TENSOR_FLOPS_PER_INST = 2048
TENSOR_ESTIMATE = (
    "tensor-pipe FLOPs converted from instructions at 2048 per instruction (an m16n8k8 MMA); "
    "Hopper's warpgroup MMAs do more per instruction, so these FLOPs may be undercounted"
)
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


# Units Nsight Compute may print (`--print-units auto`) -> factor to the base unit.
_UNIT_SCALE = {
    "": 1.0, "%": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "ns": 1.0, "nsecond": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
    "second": 1e9, "s": 1e9, "inst": 1.0, "Kinst": 1e3, "Minst": 1e6, "Ginst": 1e9,
    "warp": 1.0, "cycle": 1.0, "Kcycle": 1e3, "Mcycle": 1e6,
}  # fmt: skip


def read_ncu_csv(source: str | Path) -> list[NcuKernel]:
    """Kernels of an `ncu --csv` report (file, `.gz` file); `==PROF==` lines are skipped."""
    path = Path(source)
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as fh:
        text = fh.read()
    return parse_ncu_csv(text, origin=str(path))


def parse_ncu_csv(text: str, *, origin: str = "ncu output") -> list[NcuKernel]:
    """Kernels of `ncu --csv --page details` text (one row per kernel and metric); values in
    scaled units (`Kbyte`, `usecond`) are brought to base units, an unknown unit on one of
    the metrics this module uses is an error (never a silently wrong number)."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        raise ProfilingError(f"{origin}: not an `ncu --csv` report (no header row)")
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
        if value is None:
            continue
        metric, unit = row.get("Metric Name", ""), (row.get("Metric Unit") or "").strip()
        scale = _UNIT_SCALE.get(unit)
        if scale is None:
            if metric in METRICS:
                raise ProfilingError(f"{origin}: unknown unit {unit!r} for {metric}")
            scale = 1.0
        k.metrics[metric] = value * scale
    return [kernels[k] for k in sorted(kernels)]


def kernel_attributes(k: NcuKernel) -> dict[str, Any]:
    """Span attributes of one kernel's metrics (only those measured)."""
    attrs: dict[str, Any] = {schema.METRICS_SOURCE: "ncu", schema.METRICS_ESTIMATED: False}
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
        attrs[schema.TENSOR_PIPE_INSTRUCTIONS] = tensor
        attrs[schema.TENSOR_FLOPS] = tensor * TENSOR_FLOPS_PER_INST
        attrs[schema.TENSOR_FLOPS_PER_INSTRUCTION] = TENSOR_FLOPS_PER_INST
        flops += attrs[schema.TENSOR_FLOPS]
        seen = True
        if tensor > 0:
            attrs[schema.METRICS_ESTIMATED] = True
            attrs[schema.ESTIMATED_BECAUSE] = TENSOR_ESTIMATE
    if seen:
        attrs[schema.FLOPS] = flops
    for metric, key in (
        ("dram__bytes_read.sum", schema.DRAM_READ_BYTES),
        ("dram__bytes_write.sum", schema.DRAM_WRITE_BYTES),
        ("gpu__time_duration.sum", schema.NCU_DURATION_NS),
    ):
        if (v := k.value(metric)) is not None:
            attrs[key] = v
    occ = k.value("sm__warps_active.avg.pct_of_peak_sustained_active")
    if occ is not None:
        attrs[schema.ACHIEVED_OCCUPANCY] = occ / 100.0
    return attrs


def match_kernels(
    kernels: Sequence[RawSpan], profiled: Sequence[NcuKernel]
) -> list[tuple[RawSpan, NcuKernel]]:
    """Pair one forward's CUPTI `kernels` with Nsight Compute's `profiled` kernels by launch
    order. Both saw the same launch sequence, so the counts must be equal and every pair must
    have the same kernel name after demangling (the kernel's own identifier: CUPTI and Nsight
    Compute spell namespaces and template arguments differently). Anything else is an
    `NcuJoinError` naming the first disagreement; there is no partial match."""
    ks = sorted(  # launch order: Nsight Compute numbers kernels as they are launched
        (s for s in kernels if s.kind == "kernel"),
        key=lambda s: (int(s.attributes.get(schema.CORRELATION_ID, 0)), s.start_ns),
    )
    if len(ks) != len(profiled):
        raise NcuJoinError(
            f"Nsight Compute profiled {len(profiled)} kernels but the forward ran {len(ks)}: "
            "profile exactly one forward (warm-up excluded)"
        )
    names = [
        (base_name(str(s.attributes.get(schema.MANGLED_NAME, s.name))), base_name(p.name))
        for s, p in zip(ks, profiled, strict=True)
    ]
    wrong = [i for i, (a, b) in enumerate(names) if a != b]
    if wrong:
        a, b = names[wrong[0]]
        raise NcuJoinError(
            f"kernel names disagree at {len(wrong)} of {len(ks)} launches between CUPTI and "
            f"Nsight Compute (first: launch {wrong[0]}, CUPTI `{a}`, ncu `{b}`): the two runs "
            "did not execute the same kernels"
        )
    return list(zip(ks, profiled, strict=True))


def join_metrics(kernels: Sequence[RawSpan], profiled: Sequence[NcuKernel]) -> int:
    """Hang `profiled` metrics on one forward's CUPTI `kernels` (`match_kernels`), in place;
    returns the number joined."""
    pairs = match_kernels(kernels, profiled)
    apply_metrics(pairs)
    return len(pairs)


def apply_metrics(pairs: Sequence[tuple[RawSpan, NcuKernel]]) -> None:
    """Put each profiled kernel's metrics on its span (see `kernel_attributes`)."""
    for span, prof in pairs:
        span.attributes.update(kernel_attributes(prof))
        span.attributes[schema.NCU_KERNEL_ID] = prof.id


def ncu_path() -> str | None:
    return shutil.which("ncu")


def ncu_command(tool: str, argv: Sequence[str], metrics: Sequence[str] = METRICS) -> list[str]:
    """The Nsight Compute command that profiles `argv`'s range between
    `torch.cuda.profiler.start()` and `stop()` (every process it starts), with `metrics`,
    as a CSV `parse_ncu_csv` reads (details page, base units)."""
    return [
        tool,
        "--csv",
        "--page",
        "details",
        "--print-units",
        "base",
        "--profile-from-start",
        "off",
        "--target-processes",
        "all",
        "--clock-control",  # the clocks the K run saw (ncu locks them to base by default)
        "none",
        "--config-file",  # a user's config.ncu-cfg must not add sections to the CSV
        "off",
        "--metrics",
        ",".join(metrics),
        *argv,
    ]


def run_ncu(
    argv: Sequence[str],
    *,
    timeout_s: float = 600.0,
    metrics: Sequence[str] = METRICS,
    env: Mapping[str, str] | None = None,
) -> tuple[list[NcuKernel], float]:
    """Run `argv` (a Python command that profiles one forward between
    `torch.cuda.profiler.start()`/`stop()`) under Nsight Compute; return its kernels and the
    wall time of the profiled command (seconds, the metrics run's cost)."""
    tool = ncu_path()
    if tool is None:
        raise MetricsNotAvailableError(
            "hardware metrics not available: Nsight Compute (`ncu`) is not on PATH"
        )
    cmd = ncu_command(tool, argv, metrics)
    t0 = time.perf_counter()
    try:  # its own process group: a timeout must stop the profiled child too
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise MetricsNotAvailableError(f"Nsight Compute could not be started: {exc}") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_process_group(proc)
        raise MetricsNotAvailableError(
            f"Nsight Compute did not finish within {timeout_s:g} s (stopped, with the "
            "process it profiled)"
        ) from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        raise MetricsNotAvailableError(
            f"Nsight Compute failed (exit {proc.returncode}): "
            + " | ".join([*ncu_errors(stdout, stderr), *tail])
        )
    try:
        return parse_ncu_csv(stdout, origin="Nsight Compute's output"), wall
    except ProfilingError as exc:
        reasons = [*ncu_errors(stdout, stderr), str(exc)]
        raise MetricsNotAvailableError(" | ".join(reasons)) from None


PERMISSION_HINT = (
    "the GPU's performance counters are open to administrators only: load the driver with "
    "NVreg_RestrictProfilingToAdminUsers=0 or run as root "
    "(https://developer.nvidia.com/ERR_NVGPUCTRPERM)"
)


def ncu_errors(stdout: str, stderr: str) -> list[str]:
    """Nsight Compute's own `==ERROR==` lines from both streams (the cause, which the last
    lines of a failed run rarely hold), with a hint for the counters-permission error."""
    lines = [
        line.strip()
        for line in (stdout + "\n" + stderr).splitlines()
        if line.strip().startswith("==ERROR==")
    ]
    errors = list(dict.fromkeys(lines))
    if any("ERR_NVGPUCTRPERM" in line for line in errors):
        errors.append(PERMISSION_HINT)
    return errors


def stop_process_group(proc: subprocess.Popen[str], grace_s: float = 5.0) -> None:
    """SIGTERM the process group `proc` leads (Nsight Compute and what it profiles), then
    SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.communicate(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
