"""Does a process that ran CUPTI forward slower afterwards? A paired A/B over fresh processes.

`bench/gpu_kernel_overhead.py` once timed its variants one after another in one process,
"plain after CUPTI" last; between runs of it on one H100 the same variant's median moved by up
to 2x, so that column could not decide whether CUPTI leaves a process slower (the profiling
worker replaces its process after a K job on its word). Here each process times plain
forwards, then runs a middle block, then times plain forwards again: in the "cupti" arm the
middle block records with `CuptiTracer` (as K does) and stops it, in the "control" arm it is
plain forwards; in the "finalize" arm CUPTI records as in "cupti" and `cupti.finalize()`
(cuptiFinalize) then detaches it, the cheaper fix if it clears the slowdown. The arms take
turns process by process (their order rotated every round), and each process's after/before
ratio is compared, so drift between processes and within one cancels.

Per process: the median wall of `--iterations` synchronised forwards before and after.
Summary per case: the median after/before ratio per arm, and each CUPTI arm's over control's.
`--device cpu` runs the control arm alone (no CUPTI), to check the script with no GPU.

    python bench/gpu_after_cupti.py [--cases resnet50:8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the children run this file directly
sys.path.insert(0, str(REPO / "bench"))
from gpu_profile import build, cuda_available, run_script  # noqa: E402

ARMS = ("control", "cupti", "finalize")


def child(case: str, arm: str, device: str, iterations: int, warmup: int) -> dict[str, float]:
    """Median forward wall (ms) before and after the arm's middle block, in this process."""
    import torch

    from sidecar.profiling.gpu.cupti_tracer import CuptiTracer
    from sidecar.profiling.torch_modules import transformer_fastpath_off

    model, inputs = build(case)
    model = model.to(device)
    args = [torch.from_numpy(a).to(device) for a in inputs.values()]

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def forwards(n: int) -> list[int]:
        walls = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            model(*args)
            sync()
            walls.append(time.perf_counter_ns() - t0)
        return walls

    with torch.inference_mode(), transformer_fastpath_off(torch):
        forwards(warmup)
        before = statistics.median(forwards(iterations)) / 1e6
        tracer = CuptiTracer() if arm != "control" else None
        if tracer is not None:
            tracer.start()
        try:
            middle = statistics.median(forwards(iterations)) / 1e6
        finally:
            if tracer is not None:
                tracer.stop()
        if arm == "finalize":
            from cupti import cupti

            cupti.finalize()
        after = statistics.median(forwards(iterations)) / 1e6
    return {"before": before, "middle": middle, "after": after}


def summary(ratios: dict[str, list[float]]) -> str:
    """Each arm's median after/before ratio (its range), and over control's."""
    done = {arm: v for arm, v in ratios.items() if v}
    parts = []
    for arm, v in done.items():
        part = f"{arm} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
        if arm != "control" and "control" in done:
            over = statistics.median(v) / statistics.median(done["control"])
            part += f", {over:.2f}x control's"
        parts.append(part)
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="resnet50:8", help="model:batch, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="processes per arm and case")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (control only)")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--child", nargs=2, metavar=("CASE", "ARM"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        case, arm = a.child
        print(json.dumps(child(case, arm, a.device, a.iterations, a.warmup)))
        return 0
    on_gpu = a.device.startswith("cuda")
    if on_gpu and not cuda_available():
        print("no GPU: nothing measured (use --device cpu to check the script)")
        return 0
    arms = ARMS if on_gpu else ARMS[:1]
    print(
        f"{'case':14s} {'round':>5s} {'arm':>8s} {'before ms':>10s} {'middle ms':>10s}"
        f" {'after ms':>9s} {'after/before':>13s}"
    )
    status = 0
    for case in a.cases.split(","):
        ratios: dict[str, list[float]] = {arm: [] for arm in arms}
        for rnd in range(a.rounds):
            shift = rnd % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                argv = ["--child", case, arm, "--device", a.device]
                argv += ["--iterations", str(a.iterations), "--warmup", str(a.warmup)]
                r = run_script(__file__, *argv)
                if "error" in r:
                    print(f"{case:14s} {rnd:5d} {arm:>8s} failed: {r['error']}")
                    status = 1
                    continue
                ratio = r["after"] / r["before"]
                ratios[arm].append(ratio)
                print(
                    f"{case:14s} {rnd:5d} {arm:>8s} {r['before']:10.2f} {r['middle']:10.2f}"
                    f" {r['after']:9.2f} {ratio:12.2f}x"
                )
        print(f"{case:14s} median after/before: {summary(ratios)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
