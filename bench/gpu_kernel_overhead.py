"""Where the K run's overhead comes from: the module hooks, CUPTI, or both.

K times each forward with host-clock hooks on every module (for the layer each kernel
belongs to) and `CuptiTracer` recording kernels and their launches. `bench/gpu_profile.py`
prints K's latency over M's; this splits it. Each case runs in a fresh process (CUPTI's
one owner), its variants in this order: plain, hooks, CUPTI recording GPU work alone (no API
records: what the kernel records cost without the launches K correlates), CUPTI as K runs it,
hooks + CUPTI, plain again (a
CUPTI that stays attached after `stop()` shows as "plain after" above "plain"), and plain
once more after `cupti.finalize()` (CUPTI detached from the process, where it can be).

Per variant: the median wall of `--iterations` forwards, each ended by a device
synchronisation, and its ratio to "plain". PyTorch eager, fp32, random weights; models from
bench/gpu_profile.py. `--device cpu` runs the hook variants alone (no CUPTI), to check the
script where there is no GPU; without it, a machine with no CUDA prints "no GPU".

    python bench/gpu_kernel_overhead.py [--cases resnet50:1,resnet50:8,bert:8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the children run this file directly
sys.path.insert(0, str(REPO / "bench"))
CASES = "resnet50:1,resnet50:8,resnet50:64,bert:8"
VARIANTS = (
    "plain",
    "hooks",
    "cupti kernels",
    "cupti",
    "hooks+cupti",
    "plain after",
    "after finalize",
)


def child(case: str, device: str, iterations: int, warmup: int) -> dict[str, float]:
    """Median forward wall (ms) per variant, in this process."""
    import torch
    from gpu_profile import build

    from sidecar.profiling.gpu.cupti_tracer import CuptiTracer
    from sidecar.profiling.runners.pytorch_cuda import ModuleHooks
    from sidecar.profiling.torch_modules import hookable_modules, transformer_fastpath_off

    KernelsOnlyTracer = kernels_only_tracer()

    model, inputs = build(case)
    model = model.to(device)
    args = [torch.from_numpy(a).to(device) for a in inputs.values()]
    on_gpu = device.startswith("cuda")

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def timed(hooks: ModuleHooks | None) -> float:
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
        return statistics.median(walls) / 1e6

    out: dict[str, float] = {}
    with torch.inference_mode(), transformer_fastpath_off(torch):
        for variant in VARIANTS:
            if ("cupti" in variant or variant == "after finalize") and not on_gpu:
                continue
            if variant == "after finalize" and not finalize_cupti(out):
                continue
            tracer = None
            if "cupti" in variant:
                tracer = KernelsOnlyTracer() if variant == "cupti kernels" else CuptiTracer()
            hooks = ModuleHooks(model, events=False) if "hooks" in variant else None
            if hooks is not None:
                hooks.__enter__()
            if tracer is not None:
                tracer.start()
            try:
                out[variant] = timed(hooks)
            finally:
                if tracer is not None:
                    out[f"{variant} api_filter={tracer.api_filter}"] = 0.0
                    tracer.stop()
                if hooks is not None:
                    hooks.__exit__()
    out["modules hooked"] = float(sum(1 for name, _ in hookable_modules(model) if name))
    return out


def kernels_only_tracer() -> type:
    """`CuptiTracer` with the runtime and driver API records left off."""
    from sidecar.profiling.gpu.cupti_tracer import CuptiTracer

    class KernelsOnly(CuptiTracer):
        def _enable_api(self, cupti: Any) -> None:
            self.api_filter = "kernels only"

    return KernelsOnly


def finalize_cupti(out: dict[str, float]) -> bool:
    """Detach CUPTI from this process (`cuptiFinalize`); False, noted in `out`, where
    cupti-python has no `finalize` or CUPTI refuses."""
    from cupti import cupti

    try:
        cupti.finalize()
    except Exception as exc:  # AttributeError or a cuptiError
        out[f"finalize failed: {type(exc).__name__}: {exc}"] = 0.0
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="model:batch, comma-separated")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (no CUPTI)")
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.device, a.iterations, a.warmup)))
        return 0
    if a.device.startswith("cuda"):
        try:
            import torch

            gpu = bool(torch.cuda.is_available())
        except ImportError:
            gpu = False
        if not gpu:
            print("no GPU: nothing measured (use --device cpu to check the script)")
            return 0
    print(f"{'case':14s}" + "".join(f"{v:>15s}" for v in VARIANTS) + "   (ms, x plain)")
    status = 0
    for case in a.cases.split(","):
        child_argv = [sys.executable, __file__, "--child", case, "--device", a.device]
        child_argv += ["--iterations", str(a.iterations), "--warmup", str(a.warmup)]
        run = subprocess.run(
            child_argv,
            capture_output=True,
            text=True,
            cwd=REPO,
            check=False,
        )
        if run.returncode != 0:
            print(f"{case:14s} failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
            status = 1
            continue
        res: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
        base = res["plain"]
        cells = [
            f"{res[v]:7.2f} {res[v] / base:4.2f}x" if v in res else f"{'-':>13s}" for v in VARIANTS
        ]
        notes = [
            k
            for k in res
            if ("api_filter" in k and "kernels only" not in k) or k.startswith("finalize failed")
        ]
        hooked = int(res.get("modules hooked", 0))
        print(f"{case:14s}" + "".join(f"{c:>15s}" for c in cells), f"  {hooked} modules", *notes)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
