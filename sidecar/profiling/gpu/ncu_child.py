"""The process Nsight Compute profiles for the metrics level: one forward, nothing else.

    python -m sidecar.profiling.gpu.ncu_child MODEL --device cuda:N --inputs X.npz
        --result R.json [--kind torchscript|module] [--warmup W] [--batch B]

It loads the model as the PyTorch runner does (a TorchScript file with optimized execution
off, or an `nn.Module` saved whole with `torch.save`), runs `W` warm-up forwards outside the
profiled range and exactly one forward between `torch.cuda.profiler.start()` and `stop()`,
so `ncu --profile-from-start off` measures the kernels of that forward only. The inputs are
`arr_0`, `arr_1`, ... of the `.npz` (positional, in order). It prints nothing on stdout
(Nsight Compute's CSV goes there); the profiled forward's wall time under Nsight Compute
(kernel replays included) goes to the `--result` JSON file. Errors: one line on stderr,
exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.profiling.torch_modules import transformer_fastpath_off

CHILD_MODULE = "sidecar.profiling.gpu.ncu_child"
KINDS = ("torchscript", "module")


class ChildError(Exception):
    """The child could not profile the forward; the message says why."""


@dataclass(frozen=True)
class ChildArgs:
    model: Path
    device: str
    inputs: Path
    result: Path
    kind: str = "torchscript"
    warmup: int = 1
    batch: int | None = None

    def argv(self) -> list[str]:
        """The arguments `parse_args` reads back (after `-m sidecar.profiling.gpu.ncu_child`)."""
        out = [str(self.model), "--device", self.device, "--inputs", str(self.inputs)]
        out += ["--result", str(self.result), "--kind", self.kind, "--warmup", str(self.warmup)]
        if self.batch is not None:
            out += ["--batch", str(self.batch)]
        return out


def child_command(python: str, args: ChildArgs) -> list[str]:
    """`python -m sidecar.profiling.gpu.ncu_child ...` for `args`."""
    return [python, "-m", CHILD_MODULE, *args.argv()]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sidecar.profiling.gpu.ncu_child",
        description="Run one forward of a PyTorch model for Nsight Compute (metrics level).",
    )
    ap.add_argument("model", type=Path, help="TorchScript file, or an nn.Module saved whole")
    ap.add_argument("--device", required=True, help="cuda or cuda:N")
    ap.add_argument("--inputs", required=True, type=Path, help=".npz with arr_0, arr_1, ...")
    ap.add_argument("--result", required=True, type=Path, help="JSON file written at the end")
    ap.add_argument("--kind", choices=KINDS, default="torchscript")
    ap.add_argument("--warmup", type=int, default=1, help="forwards before the profiled one")
    ap.add_argument("--batch", type=int, help="check the first input's first dimension is this")
    return ap


def parse_args(argv: Sequence[str]) -> ChildArgs:
    """The child's arguments; `ChildError` for a bad device or count (argparse exits on
    unknown flags)."""
    ns = _parser().parse_args(list(argv))
    device = str(ns.device)
    if not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ChildError(f"--device {device!r}: use cuda or cuda:N")
    if ns.warmup < 0:
        raise ChildError(f"--warmup must be 0 or more, got {ns.warmup}")
    if ns.batch is not None and ns.batch < 1:
        raise ChildError(f"--batch must be at least 1, got {ns.batch}")
    return ChildArgs(ns.model, device, ns.inputs, ns.result, ns.kind, ns.warmup, ns.batch)


def load_inputs(path: Path, batch: int | None) -> list[Any]:
    """The positional inputs `arr_0`, `arr_1`, ... of an `.npz` (numpy arrays)."""
    import numpy as np

    try:
        with np.load(path) as npz:
            names = sorted(npz.files, key=lambda n: int(n.rpartition("_")[2]))
            arrays = [npz[n] for n in names]
    except (OSError, ValueError) as exc:
        raise ChildError(f"cannot read inputs {path}: {exc}") from None
    if not arrays:
        raise ChildError(f"{path} holds no inputs")
    first = arrays[0]
    if batch is not None and (first.ndim == 0 or first.shape[0] != batch):
        raise ChildError(f"input {names[0]} has shape {first.shape}, not batch {batch}")
    return arrays


def load_model(torch: Any, args: ChildArgs) -> Any:
    if not args.model.is_file():
        raise ChildError(f"model file not found: {args.model}")
    try:
        if args.kind == "torchscript":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                model = torch.jit.load(str(args.model), map_location=args.device)
        else:
            model = torch.load(str(args.model), map_location=args.device, weights_only=False)
    except Exception as exc:
        raise ChildError(f"cannot load {args.kind} model {args.model}: {exc}") from None
    return model.eval()


@contextlib.contextmanager
def _context(torch: Any, scripted: bool) -> Iterator[None]:
    """As the PyTorch runner: inference mode, the fused transformer path off (the K run it
    is matched with ran without it), TorchScript's optimized execution off."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(transformer_fastpath_off(torch))
        if scripted:
            stack.enter_context(torch.jit.optimized_execution(False))
        yield


def profile_one_forward(args: ChildArgs) -> dict[str, Any]:
    """Warm up, then one forward inside the profiler range; what the result file holds."""
    import torch

    if not torch.cuda.is_available():
        raise ChildError("CUDA is not available in the metrics child")
    device = torch.device(args.device if ":" in args.device else "cuda:0")
    model = load_model(torch, args)
    inputs = [torch.from_numpy(a).to(device) for a in load_inputs(args.inputs, args.batch)]
    scripted = isinstance(model, torch.jit.ScriptModule)
    with torch.cuda.device(device), _context(torch, scripted):
        for _ in range(args.warmup):
            model(*inputs)
        torch.cuda.synchronize(device)
        torch.cuda.profiler.start()
        t0 = time.perf_counter_ns()
        model(*inputs)
        torch.cuda.synchronize(device)
        t1 = time.perf_counter_ns()
        torch.cuda.profiler.stop()
    return {
        "forward_ns": t1 - t0,
        "warmup": args.warmup,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        result = profile_one_forward(args)
        args.result.write_text(json.dumps(result))
    except ChildError as exc:
        print(f"ncu_child: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
