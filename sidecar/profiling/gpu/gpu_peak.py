"""Roofs of NVIDIA GPUs: data-sheet figures, and measured ones cached once per GPU.

The data-sheet figures are NVIDIA's published dense peaks (no sparsity) per product; the
roofline uses the FP32 (CUDA core) peak as `flops_per_s` and keeps the tensor-core peaks
beside it. `measure_gpu_peak` (GPU only) times a large FP32 matmul (TF32 off) and a
device-to-device copy with CUDA events and keeps the best of a few repeats; the result is
cached in `$XSP_CACHE_DIR/gpu-peak-<name>.json` like the CPU peak in `peak.py`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.profiling.peak import Peak, cache_dir, write_cache
from sidecar.trace import schema

TERA = 1e12


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's data-sheet peaks (dense), FLOP/s and bytes/s."""

    name: str
    fp32_flops: float
    tf32_tensor_flops: float
    fp16_tensor_flops: float
    fp64_flops: float
    dram_bytes_per_s: float
    source: str


DATASHEETS: dict[str, GpuSpec] = {
    "H100 SXM": GpuSpec(
        "NVIDIA H100 SXM5 80GB", 66.9 * TERA, 494.7 * TERA, 989.4 * TERA, 33.5 * TERA,
        3.35 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
    ),
    "H100 PCIe": GpuSpec(
        "NVIDIA H100 PCIe 80GB", 51.2 * TERA, 378.0 * TERA, 756.0 * TERA, 25.6 * TERA,
        2.0 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)",
    ),
    "H100 NVL": GpuSpec(
        "NVIDIA H100 NVL 94GB", 60.0 * TERA, 417.5 * TERA, 835.0 * TERA, 30.0 * TERA,
        3.9 * TERA, "NVIDIA H100 Tensor Core GPU datasheet (NVL)",
    ),
    "H200": GpuSpec(
        "NVIDIA H200 SXM 141GB", 66.9 * TERA, 494.7 * TERA, 989.4 * TERA, 33.5 * TERA,
        4.8 * TERA, "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
    ),
}  # fmt: skip


def datasheet(device_name: str) -> GpuSpec | None:
    """The data-sheet entry for a device name as CUDA reports it, e.g.
    `NVIDIA H100 80GB HBM3` (the SXM5 part), `NVIDIA H100 PCIe`, `NVIDIA H200`. Parts with
    other figures (GH200, H200 NVL, a MIG slice) have no entry: None rather than another part's
    roofs."""
    n = device_name.upper()
    if "MIG" in n:  # a MIG slice has a fraction of the part's SMs and bandwidth
        return None
    if re.search(r"\bH200\b", n):
        return None if "NVL" in n else DATASHEETS["H200"]
    if re.search(r"\bH100\b", n):
        if "PCIE" in n:
            return DATASHEETS["H100 PCIe"]
        if "NVL" in n:
            return DATASHEETS["H100 NVL"]
        return DATASHEETS["H100 SXM"]  # "H100 80GB HBM3" and "H100 SXM5" are the SXM5 part
    return None


@dataclass(frozen=True)
class GpuPeak:
    """The roofs a GPU trace records: measured where possible, data sheet beside."""

    peak: Peak
    datasheet: GpuSpec | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def trace_attributes(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            schema.PEAK_FLOPS_PER_S: self.peak.flops_per_s,
            schema.PEAK_DRAM_BYTES_PER_S: self.peak.dram_bytes_per_s,
            schema.PEAK_SOURCE: self.peak.source,
        }
        if self.datasheet is not None:
            d = self.datasheet
            out["peak_datasheet"] = {
                "name": d.name,
                "fp32_flops_per_s": d.fp32_flops,
                "tf32_tensor_flops_per_s": d.tf32_tensor_flops,
                "fp16_tensor_flops_per_s": d.fp16_tensor_flops,
                "fp64_flops_per_s": d.fp64_flops,
                "dram_bytes_per_s": d.dram_bytes_per_s,
                "source": d.source,
            }
        out.update(self.extra)
        return out


def datasheet_peak(device_name: str, compute: str = "fp32") -> GpuPeak:
    """Roofs from the data sheet only (no GPU needed): `peak_source` = `gpu-spec (...)`.
    `compute` picks the FLOP roof: `fp32` (CUDA cores), `tf32` or `fp16` (tensor cores):
    a run whose FLOPs are mostly tensor-pipe FLOPs needs the tensor roof."""
    spec = datasheet(device_name)
    if spec is None:
        raise LookupError(f"no data-sheet peaks known for {device_name!r}")
    roofs = {
        "fp32": spec.fp32_flops,
        "tf32": spec.tf32_tensor_flops,
        "fp16": spec.fp16_tensor_flops,
    }
    if compute not in roofs:
        raise ValueError(f"unknown compute roof {compute!r}: use fp32, tf32 or fp16")
    source = f"gpu-spec ({compute}, {spec.source})"
    peak = Peak(roofs[compute], spec.dram_bytes_per_s, source, device_name, 0)
    return GpuPeak(peak, spec)


def ran_on_tensor_pipe(spans: Iterable[Any]) -> bool:
    """Did any kernel among `spans` execute tensor-pipe instructions (Nsight Compute's
    `tensor_pipe_instructions` on the kernel spans)?"""
    return any(float(s.attributes.get(schema.TENSOR_PIPE_INSTRUCTIONS) or 0) > 0 for s in spans)


def roof_attributes(gpu_peak: GpuPeak, spans: Iterable[Any]) -> dict[str, Any]:
    """The roofs a GPU trace is judged against: the data sheet's TF32 tensor roof when its
    kernels ran on the tensor pipe and the data sheet knows the GPU (an FP32 roof would put
    those kernels above it), else `gpu_peak`'s own; the measured roof stays beside
    (`peak_measured`). Recorded and live traces pick it the same way."""
    attrs = gpu_peak.trace_attributes()
    spec = gpu_peak.datasheet
    if spec is None or not ran_on_tensor_pipe(spans):
        return attrs
    keys = (schema.PEAK_FLOPS_PER_S, schema.PEAK_DRAM_BYTES_PER_S, schema.PEAK_SOURCE)
    attrs[schema.PEAK_MEASURED] = {k: attrs[k] for k in keys}
    attrs.update(
        {
            schema.PEAK_FLOPS_PER_S: spec.tf32_tensor_flops,
            schema.PEAK_DRAM_BYTES_PER_S: spec.dram_bytes_per_s,
            schema.PEAK_SOURCE: f"gpu-spec (tf32, {spec.source})",
        }
    )
    return attrs


def measure_gpu_peak(device: str = "cuda:0", repeats: int = 5) -> Peak:  # pragma: no cover
    """FP32 matmul and device copy roofs of one GPU, timed with CUDA events (GPU only)."""
    import torch

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev)
    n = 8192
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    src = torch.empty(512 * 1024 * 1024 // 4, device=dev)  # 512 MiB
    dst = torch.empty_like(src)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:

        def best_ms(fn: Any) -> float:
            fn()
            torch.cuda.synchronize(dev)
            best = float("inf")
            for _ in range(repeats):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                best = min(best, e0.elapsed_time(e1))
            return best

        with torch.cuda.device(dev):  # events record on the current device's stream
            mm = best_ms(lambda: torch.mm(a, b))
            cp = best_ms(lambda: dst.copy_(src))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    flops = 2.0 * n**3 / (mm / 1e3)
    bw = 2.0 * src.numel() * 4 / (cp / 1e3)
    return Peak(flops, bw, "gpu-microbenchmark", gpu_key(name), time.time_ns())


def gpu_key(name: str) -> str:
    import torch

    return f"{name} | torch={torch.__version__} | cuda={torch.version.cuda}"


def get_gpu_peak(
    device: str = "cuda:0", refresh: bool = False, path: Path | None = None
) -> GpuPeak:  # pragma: no cover - needs a GPU
    """The cached measured roofs of this GPU (measured when absent), data sheet beside."""
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    path = path or cache_dir() / f"gpu-peak-{re.sub(r'[^A-Za-z0-9]+', '-', name)}.json"
    key = gpu_key(name)
    peak: Peak | None = None
    if not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("machine") == key:
                peak = Peak(**data)
        except (OSError, ValueError, TypeError):
            pass
    if peak is None:
        peak = measure_gpu_peak(device)
        write_cache(path, peak)
    return GpuPeak(peak, datasheet(name))
