"""Models the PyTorch runner meets beyond plain eager trees (real PyTorch, CPU): transformer
layers with PyTorch's fused fast path, and eager models holding a TorchScript part."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from sidecar.profiling.runners.pytorch import PyTorchRunner
from sidecar.profiling.runners.pytorch_cuda import ModuleHooks
from sidecar.profiling.torch_modules import hookable_modules
from sidecar.trace.spans import Level


class FastpathProbe(nn.Module):
    """A TransformerEncoderLayer that notes whether PyTorch's fused path was allowed."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.seen: list[bool] = []

    def forward(self, x: Any) -> Any:
        self.seen.append(torch.backends.mha.get_fastpath_enabled())
        return self.layer(x)


def test_every_level_runs_the_transformer_path_the_hooks_leave() -> None:
    """Hooks make PyTorch leave the fused encoder path; M must time the same program."""
    model = FastpathProbe().eval()
    runner = PyTorchRunner(model)
    x = {"x": np.random.rand(2, 8, 32).astype(np.float32)}
    before = torch.backends.mha.get_fastpath_enabled()
    for level in (Level.MODEL, Level.LAYER):
        run = runner.run(x, level, 2, 1)
        assert run.attributes["transformer_fastpath"] is False
    assert model.seen and not any(model.seen)
    assert torch.backends.mha.get_fastpath_enabled() == before  # restored after each run


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class WithScriptedPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scripted = torch.jit.script(Small())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scripted(x))


def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_scripted_part_is_timed_inside_its_parent() -> None:
    """PyTorch refuses hooks on ScriptModules: the eager parts get layers, the scripted
    part none, and no run leaves a hook behind."""
    model = WithScriptedPart().eval()
    assert [n for n, _ in hookable_modules(model)] == ["", "head"]
    runner = PyTorchRunner(model)
    run = runner.run({"x": np.random.rand(3, 8).astype(np.float32)}, Level.LAYER, 2, 1)
    names = {s.name for it in run.iterations for s in it.spans if s.level is Level.LAYER}
    assert names == {"head"}
    with ModuleHooks(model, events=False) as hooks:
        model(torch.rand(3, 8))
    assert [c.name for c in hooks.calls] == ["head"]
    assert hooks_on(model) == 0


def test_hooks_are_removed_when_hooking_fails_midway(monkeypatch: pytest.MonkeyPatch) -> None:
    model = WithScriptedPart().eval()
    model.extra = nn.ReLU()

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("hook refused")

    monkeypatch.setattr(model.extra, "register_forward_hook", refuse)
    with pytest.raises(RuntimeError, match="hook refused"), ModuleHooks(model, events=False):
        pass
    assert hooks_on(model) == 0  # the hooks put on `head` before the failure are gone


def test_a_module_whose_children_never_run_is_a_leaf() -> None:
    """nn.MultiheadAttention uses `out_proj.weight` without calling `out_proj`: the attention
    call is a leaf (its time counts among the leaves), not an empty container."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    with torch.inference_mode(), ModuleHooks(layer, events=False) as hooks:
        layer(torch.rand(2, 4, 16))
    leaf = {c.name: c.leaf for c in hooks.calls}
    assert "self_attn.out_proj" not in leaf and leaf["self_attn"] is True
    assert leaf["linear1"] is True and leaf["dropout1"] is True
