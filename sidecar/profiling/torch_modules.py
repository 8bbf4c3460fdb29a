"""PyTorch module helpers shared by the PyTorch runner, its CUDA levels and the Nsight Compute
child: which modules can be hooked, and the one program every level runs.

`torch` is passed in or imported on call: importing this module loads no PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def hookable_modules(model: Any) -> list[tuple[str, Any]]:
    """`model.named_modules()` without TorchScript submodules and what lies under them:
    PyTorch refuses hooks on a ScriptModule, so a scripted part of an eager model is timed
    inside its parent's span only."""
    import torch

    scripted: list[str] = []
    out: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in scripted):
            continue
        if name and isinstance(module, torch.jit.ScriptModule):
            scripted.append(name)
            continue
        out.append((name, module))
    return out


@contextlib.contextmanager
def transformer_fastpath_off(torch: Any) -> Iterator[None]:
    """Every level runs `nn.TransformerEncoderLayer`'s plain path: PyTorch leaves its fused
    path (`aten::_transformer_encoder_layer_fwd`) as soon as any submodule has a hook, so
    with the fused path on, M would time a different program than L and K hook."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)


def is_op(event: Any) -> bool:
    """A torch.profiler event of an operator (`aten::...`), not one of the sidecar's marks."""
    return "::" in event.name and not event.name.startswith("xsp::")


def outermost_ops(event: Any) -> list[Any]:
    """Operator events (`aten::...`) with no operator above them: the calls a layer makes.
    Module and method events (`forward`, `_conv_forward`) are looked through."""
    out: list[Any] = []
    stack = list(event.cpu_children)
    while stack:
        e = stack.pop()
        if is_op(e):
            out.append(e)
        else:
            stack.extend(e.cpu_children)
    out.sort(key=lambda e: e.time_range.start)
    return out
