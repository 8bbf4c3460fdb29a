"""Where the K run's overhead comes from: the module hooks, CUPTI, or both.

K times each forward with host-clock hooks on every module (for the layer each kernel
belongs to) and `CuptiTracer` recording kernels and their launches. `bench/gpu_profile.py`
prints K's latency over M's; this splits it into variants: plain, hooks, CUPTI recording GPU
work alone (no API records: what the kernel records cost without the launches K correlates),
CUPTI as K runs it, hooks + CUPTI.

Each variant runs in a fresh process of its own, and the variants take turns over `--rounds`
rounds (their order rotated each round): CUPTI leaves a process that ran it slower (1.2-2.1x,
`bench/gpu_after_cupti.py`), and at launch-bound sizes a process's host speed shifts in steps,
so variants timed one after another in one process moved by up to 2x between runs on an H100.
Per variant: the median over its processes of each process's median wall of `--iterations`
forwards, each ended by a device synchronisation, its ratio to "plain", and the range of its
processes. PyTorch eager, fp32, random weights; models from bench/gpu_profile.py.
`--device cpu` runs the hook variants alone (no CUPTI), to check the script where there is no
GPU; without it, a machine with no CUDA prints "no GPU".

    python bench/gpu_kernel_overhead.py [--cases resnet50:1,resnet50:8,bert:8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the children run this file directly
sys.path.insert(0, str(REPO / "bench"))
from gpu_profile import build, cuda_available, run_script  # noqa: E402

CASES = "resnet50:1,resnet50:8,resnet50:64,bert:8"
VARIANTS = ("plain", "hooks", "cupti kernels", "cupti", "hooks+cupti")


def child(case: str, variant: str, device: str, iterations: int, warmup: int) -> dict[str, Any]:
    """Median forward wall (ms) of one variant, in this (fresh) process."""
    import torch

    from sidecar.profiling.gpu.cupti_tracer import CuptiTracer
    from sidecar.profiling.runners.pytorch_cuda import ModuleHooks
    from sidecar.profiling.torch_modules import hookable_modules, transformer_fastpath_off

    model, inputs = build(case)
    model = model.to(device)
    args = [torch.from_numpy(a).to(device) for a in inputs.values()]
    on_gpu = device.startswith("cuda")

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    out: dict[str, Any] = {}
    with torch.inference_mode(), transformer_fastpath_off(torch):
        tracer = None
        if "cupti" in variant:
            tracer = kernels_only_tracer()() if variant == "cupti kernels" else CuptiTracer()
        hooks = ModuleHooks(model, events=False) if "hooks" in variant else None
        if hooks is not None:
            hooks.__enter__()
        if tracer is not None:
            tracer.start()
        try:
            for _ in range(warmup):
                model(*args)
            sync()
            walls = []
            for _ in range(iterations):
                if hooks is not None:
                    hooks.reset()
                t0 = time.perf_counter_ns()
                model(*args)
                sync()
                walls.append(time.perf_counter_ns() - t0)
            out["ms"] = statistics.median(walls) / 1e6
        finally:
            if tracer is not None:
                out["api_filter"] = tracer.api_filter
                tracer.stop()
            if hooks is not None:
                hooks.__exit__()
    out["modules hooked"] = sum(1 for name, _ in hookable_modules(model) if name)
    return out


def kernels_only_tracer() -> type:
    """`CuptiTracer` with the runtime and driver API records left off."""
    from sidecar.profiling.gpu.cupti_tracer import CuptiTracer

    class KernelsOnly(CuptiTracer):
        def _enable_api(self, cupti: Any) -> None:
            self.api_filter = "kernels only"

    return KernelsOnly


def run_child(case: str, variant: str, a: argparse.Namespace) -> dict[str, Any]:
    """One variant of a case in a fresh process: its result, or {"error": why it failed}."""
    argv = ["--child", case, variant, "--device", a.device]
    return run_script(__file__, *argv, "--iterations", str(a.iterations), "--warmup", str(a.warmup))


def cells(walls: dict[str, list[float]]) -> list[str]:
    """Each variant's median over its processes (ms) and its ratio to plain's."""
    med = {v: statistics.median(w) for v, w in walls.items() if w}
    base = med.get("plain")
    return [
        f"{med[v]:7.2f} {med[v] / base:4.2f}x" if v in med and base else f"{'-':>13s}"
        for v in walls
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="model:batch, comma-separated")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (no CUPTI)")
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="processes per variant and case")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child, a.device, a.iterations, a.warmup)))
        return 0
    if a.device.startswith("cuda") and not cuda_available():
        print("no GPU: nothing measured (use --device cpu to check the script)")
        return 0
    variants = [v for v in VARIANTS if "cupti" not in v or a.device.startswith("cuda")]
    print(f"{'case':14s}" + "".join(f"{v:>15s}" for v in variants) + "   (ms, x plain)")
    status = 0
    for case in a.cases.split(","):
        walls: dict[str, list[float]] = {v: [] for v in variants}
        notes: set[str] = set()
        hooked = 0
        for rnd in range(a.rounds):
            shift = rnd % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                res = run_child(case, variant, a)
                if "error" in res:
                    print(f"{case:14s} {variant} failed: {res['error']}")
                    status = 1
                    continue
                walls[variant].append(res["ms"])
                hooked = int(res["modules hooked"])
                if "api_filter" in res and variant != "cupti kernels":
                    notes.add(f"{variant} api_filter={res['api_filter']}")
        print(f"{case:14s}" + "".join(f"{c:>15s}" for c in cells(walls)), f"  {hooked} modules",
              *sorted(notes))  # fmt: skip
        spreads = ", ".join(f"{v} {min(w):.2f}-{max(w):.2f}" for v, w in walls.items() if w)
        print(f"{'':14s} ms by process: {spreads}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
