"""Level K of a Python-backend model whose code runs PyTorch: the ATen ops below its calls.

In the K run only, when a model's module imports `torch`, every `execute` runs under
`torch.profiler` (CPU activity, shapes recorded) inside a `record_function` mark. The marks
map the profiler's clock onto ours (one offset per run, `timing.align_offset`), and the
outermost operator events inside each mark become kernel spans (`cpu_op`, named after the op,
`input_shapes`, `runtime` `pytorch`), children by containment of the Python call that ran them
(e.g. the model's call of its `torch.nn.Module`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

from sidecar.profiling.gpu.owner import PROCESS_OWNER, TORCH_PROFILER
from sidecar.profiling.runners.timing import align_offset
from sidecar.profiling.torch_modules import outermost_ops
from sidecar.profiling.vocabulary import RawSpan
from sidecar.trace import schema
from sidecar.trace.spans import Level

MARK = "xsp::python_execute"


def imports_torch(modules: Iterable[ModuleType]) -> bool:
    """Whether any of the models' modules imported torch (or something from it)."""
    for module in modules:
        for value in vars(module).values():
            name = getattr(value, "__name__", "") if isinstance(value, ModuleType) else ""
            owner = name or str(getattr(value, "__module__", "") or "")
            if owner.split(".")[0] == "torch":
                return True
    return False


class TorchOps:
    """The profiler of one K run: `profiling()` around the run, `mark()` around each execute."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.events: list[Any] = []

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        if self.torch.cuda.is_available():  # Kineto is a CUPTI client on a CUDA build
            PROCESS_OWNER.claim(TORCH_PROFILER)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            yield
        self.events = list(prof.events())

    def mark(self) -> contextlib.AbstractContextManager[Any]:
        from torch.autograd.profiler import record_function

        return record_function(MARK)

    def spans(self, walls: Sequence[tuple[int, int]]) -> list[list[RawSpan]]:
        """Per timed execute (its epoch-ns interval in `walls`), its outermost ops as spans."""
        marks = sorted((e for e in self.events if e.name == MARK), key=lambda e: e.time_range.start)
        marks = marks[-len(walls) :]
        if not walls or len(marks) != len(walls):
            return [[] for _ in walls]
        offset = align_offset(
            walls, [(_ns(m.time_range.start), _ns(m.time_range.end)) for m in marks]
        )
        out = []
        for mark in marks:
            out.append([_op_span(op, offset) for op in outermost_ops(mark)])
        return out


def _ns(us: float) -> int:
    return round(us * 1000)


def _op_span(event: Any, offset: int) -> RawSpan:
    attrs = {
        schema.OP_TYPE: event.name,
        schema.RUNTIME: "pytorch",
        schema.INPUT_SHAPES: [list(s) for s in (event.input_shapes or [])],
        schema.DEVICE: "cpu",
    }
    start = _ns(event.time_range.start) + offset
    end = _ns(event.time_range.end) + offset
    return RawSpan(Level.KERNEL, event.name, "cpu_op", start, end, attributes=attrs)
