"""Leveled profiling on a CUDA GPU: overhead of each level, kernels attributed, kernel sums.

For ResNet-50 at b1/b8/b64/b256 and a BERT-base-shaped encoder at b8x128 (PyTorch eager,
fp32, random weights), each case in a fresh process (one CUPTI owner per process):

- M: model latency (trimmed mean); L/K: each level's model latency over M's (median of three
  leveled experiments, each in its own process: CUPTI left attached slows a later M);
  goals K <= 1.05 at b64 and <= 1.15 at b8;
- attributed: share of the K run's kernels that got a layer (goal >= 0.99);
- kernels: the kernel-time sum per forward from CuptiTracer, against torch.profiler's in a
  separate process (goal within 2 %);
- metrics: Nsight Compute over one forward when `ncu` is on PATH (kernels joined, wall s;
  `--no-ncu` skips it: minutes per case).

Every process runs nn.TransformerEncoderLayer without PyTorch's fused path, as the runner
does at every level (hooks make PyTorch leave it), so all sides time the same kernels.

Prints "no GPU" and exits 0 where CUDA is not available.

    python bench/gpu_profile.py [--cases resnet50:1,resnet50:8,...] [--iterations 20]
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
CASES = ("resnet50:1", "resnet50:8", "resnet50:64", "resnet50:256", "bert:8")
SEQ = 128


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resnet50() -> Any:
    """torchvision's ResNet-50 when importable, else the same Bottleneck structure."""
    try:
        import torchvision

        return torchvision.models.resnet50()
    except ImportError:
        pass
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x: Any) -> Any:
            idt = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + idt)

    class ResNet50(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin, layers = 64, []
            for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
                blocks = []
                for i in range(n):
                    blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                    cin = width * 4
                layers.append(nn.Sequential(*blocks))
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(2048, 1000)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet50()


def bert() -> Any:
    """A BERT-base-shaped encoder: 12 layers, d=768, 12 heads, FFN 3072 (input: hidden)."""
    from torch import nn

    layer = nn.TransformerEncoderLayer(768, 12, 3072, activation="gelu", batch_first=True)
    return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)


def build(case: str) -> tuple[Any, dict[str, Any]]:
    import numpy as np

    name, batch = case.split(":")
    b = int(batch)
    rng = np.random.default_rng(0)
    if name == "resnet50":
        return resnet50().eval(), {"input": rng.random((b, 3, 224, 224), dtype=np.float32)}
    return bert().eval(), {"hidden": rng.random((b, SEQ, 768), dtype=np.float32)}


EXPERIMENTS = 3  # leveled experiments per case, each in a fresh process


def child_leveled(case: str, iterations: int, warmup: int) -> dict[str, Any]:
    """One leveled experiment of a case in this (fresh) process. One per process: CUPTI
    left attached after a K run slows later forwards (1.2-2.1x at launch-bound sizes on an
    H100, `bench/gpu_after_cupti.py`), so a second experiment's M would read high."""
    from sidecar.profiling.experiment import run_experiment
    from sidecar.profiling.runners.pytorch import PyTorchRunner
    from sidecar.trace.spans import Level

    model, inputs = build(case)
    runner = PyTorchRunner(model, device="cuda")
    res = run_experiment(runner, inputs, model=case, iterations=iterations, warmup=warmup)
    kernels = [s for s in res.spans_at(Level.KERNEL) if s.kind == "kernel"]
    k_run = res.runs[Level.KERNEL]
    sums = [sum(s.duration_ns for s in it.spans if s.kind == "kernel") for it in k_run.iterations]
    return {
        "m_ms": res.stats(Level.MODEL).trimmed_mean_ns / 1e6,
        "l_x": res.stats(Level.LAYER).overhead_ratio,
        "k_x": res.stats(Level.KERNEL).overhead_ratio,
        "attributed": sum(bool(k.parent_id) for k in kernels) / max(len(kernels), 1),
        "kernel_ms": statistics.median(sums) / 1e6,
        "kernels": len(kernels),
    }


def leveled(case: str, *args: str) -> dict[str, Any]:
    """The median of `EXPERIMENTS` experiments, each in its own process."""
    runs = [run_child("--leveled", case, *args) for _ in range(EXPERIMENTS)]
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def child_torch_profiler(case: str, iterations: int, warmup: int) -> dict[str, Any]:
    """torch.profiler's kernel-time sum per forward (its own process: CUPTI's one owner)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sidecar.profiling.torch_modules import transformer_fastpath_off

    model, inputs = build(case)
    model = model.cuda()
    args = [torch.from_numpy(a).cuda() for a in inputs.values()]
    with torch.inference_mode(), transformer_fastpath_off(torch):
        for _ in range(warmup):
            model(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iterations):
                model(*args)
            torch.cuda.synchronize()
    total_us = sum(e.device_time for e in prof.events() if is_device_kernel(e.name, e.device_type))
    return {"torch_kernel_ms": total_us / 1e3 / iterations}


def is_device_kernel(name: str, device_type: Any) -> bool:
    """A kernel on the GPU among torch.profiler's events: ours count kernels only, so its
    memsets and memcpys ("Memset (Device)", "Memcpy HtoD ...") stay out of its sum too."""
    return str(device_type).endswith("CUDA") and not name.startswith(("Memset", "Memcpy"))


def child_ncu_forward(case: str) -> None:
    """One forward between cudaProfilerStart/Stop (what `ncu --profile-from-start off` sees)."""
    import torch

    from sidecar.profiling.torch_modules import transformer_fastpath_off

    model, inputs = build(case)
    model = model.cuda()
    args = [torch.from_numpy(a).cuda() for a in inputs.values()]
    with torch.inference_mode(), transformer_fastpath_off(torch):
        for _ in range(3):
            model(*args)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        model(*args)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def run_script(script: str, *argv: str) -> dict[str, Any]:
    """`script ARGV` in a fresh Python process (one CUPTI owner each): the JSON object its
    last line prints, or {"error": its last line of stderr}. The GPU benches' children."""
    out = subprocess.run(
        [sys.executable, script, *argv], capture_output=True, text=True, cwd=REPO, check=False
    )
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run_child(*argv: str) -> dict[str, Any]:
    return run_script(__file__, *argv)


def metrics(case: str) -> str:
    from sidecar.profiling.gpu.ncu import MetricsNotAvailableError, run_ncu

    try:
        kernels, wall = run_ncu([sys.executable, __file__, "--ncu-forward", case])
    except MetricsNotAvailableError as exc:
        return str(exc)
    return f"{len(kernels)} kernels, {wall:.1f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-ncu", action="store_true", help="skip the Nsight Compute column")
    ap.add_argument("--leveled", metavar="CASE", help=argparse.SUPPRESS)
    ap.add_argument("--torch-profiler", metavar="CASE", help=argparse.SUPPRESS)
    ap.add_argument("--ncu-forward", metavar="CASE", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not cuda_available():
        print("no GPU: CUDA is not available here (bench/gpu_profile.py needs one)")
        return 0
    if args.leveled:
        print(json.dumps(child_leveled(args.leveled, args.iterations, args.warmup)))
        return 0
    if args.torch_profiler:
        print(json.dumps(child_torch_profiler(args.torch_profiler, args.iterations, args.warmup)))
        return 0
    if args.ncu_forward:
        child_ncu_forward(args.ncu_forward)
        return 0
    import torch

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | fp32 eager")
    head = (
        f"{'case':<14}{'M ms':>8}{'L x':>7}{'K x':>7}{'attrib':>8}{'kernels':>9}"
        f"{'ours ms':>9}{'torch ms':>9}{'diff %':>8}  metrics"
    )
    print(head)
    n = ["--iterations", str(args.iterations), "--warmup", str(args.warmup)]
    for case in args.cases.split(","):
        t0 = time.perf_counter()
        ours = leveled(case, *n)
        ref = run_child("--torch-profiler", case, *n)
        if "error" in ours or "error" in ref:
            print(f"{case:<14}error: {ours.get('error') or ref.get('error')}")
            continue
        diff = 100 * (ours["kernel_ms"] / ref["torch_kernel_ms"] - 1)
        print(
            f"{case:<14}{ours['m_ms']:>8.2f}{ours['l_x']:>7.2f}{ours['k_x']:>7.2f}"
            f"{ours['attributed']:>8.3f}{ours['kernels']:>9.0f}{ours['kernel_ms']:>9.3f}"
            f"{ref['torch_kernel_ms']:>9.3f}{diff:>8.2f}  "
            f"{'skipped (--no-ncu)' if args.no_ncu else metrics(case)}"
            f"  ({time.perf_counter() - t0:.0f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
