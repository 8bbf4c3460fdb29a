"""The live Nsight Compute metrics level: the command, the child's arguments, the launch-order
match against the real H100 recordings, and parse -> spans with a fake `ncu` (named so)
that prints the real ncu CSV. `ncu` itself runs only where CUDA and ncu are present."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sidecar.profiling.gpu import metrics_level as ml
from sidecar.profiling.gpu.demangle import base_name, demangle
from sidecar.profiling.gpu.ncu import (
    METRICS,
    NcuJoinError,
    kernel_attributes,
    match_kernels,
    ncu_command,
    parse_ncu_csv,
    read_ncu_csv,
)
from sidecar.profiling.gpu.ncu_child import ChildArgs, ChildError, child_command, parse_args
from sidecar.profiling.gpu.recording import Recording, RecordingRunner
from sidecar.profiling.vocabulary import Iteration, ProfilingError
from sidecar.trace.spans import Level
from tests.gpu.conftest import NCU_B8

INPUTS = {"input": np.zeros((8, 3, 224, 224), dtype=np.float32)}


def _kernels(spans: list) -> list:
    return sorted((s for s in spans if s.kind == "kernel"), key=lambda s: s.start_ns)


def test_ncu_command_profiles_only_the_marked_range() -> None:
    cmd = ncu_command("/opt/ncu", ["python", "-m", "child"])
    assert cmd == [
        "/opt/ncu", "--csv", "--page", "details", "--print-units", "base",
        "--profile-from-start", "off", "--target-processes", "all",
        "--clock-control", "none", "--config-file", "off",
        "--metrics", ",".join(METRICS), "python", "-m", "child",
    ]  # fmt: skip
    assert "dram__bytes_read.sum" in cmd[cmd.index("--metrics") + 1].split(",")


def test_child_arguments_round_trip() -> None:
    args = ChildArgs(Path("m.pt"), "cuda:1", Path("x.npz"), Path("r.json"), "module", 3, 8)
    cmd = child_command("/usr/bin/python3", args)
    assert cmd[:3] == ["/usr/bin/python3", "-m", "sidecar.profiling.gpu.ncu_child"]
    assert parse_args(cmd[3:]) == args
    plain = parse_args(["m.pt", "--device", "cuda", "--inputs", "x.npz", "--result", "r.json"])
    assert (plain.kind, plain.warmup, plain.batch) == ("torchscript", 1, None)
    with pytest.raises(ChildError, match="use cuda or cuda:N"):
        parse_args(["m.pt", "--device", "cpu", "--inputs", "x", "--result", "r"])
    with pytest.raises(ChildError, match="--warmup must be 0 or more"):
        parse_args(["m.pt", "--device", "cuda:0", "--inputs", "x", "--result", "r", "--warmup=-1"])
    with pytest.raises(SystemExit):  # argparse: a required flag is missing
        parse_args(["m.pt", "--device", "cuda:0"])


def test_child_reads_positional_inputs_and_checks_the_batch(tmp_path: Path) -> None:
    from sidecar.profiling.gpu.ncu_child import load_inputs

    arrays = [np.full((4, 2), i, dtype=np.float32) for i in range(12)]  # arr_10 after arr_9
    np.savez(tmp_path / "x.npz", *arrays)
    got = load_inputs(tmp_path / "x.npz", 4)
    assert [int(a[0, 0]) for a in got] == list(range(12))
    with pytest.raises(ChildError, match=r"arr_0 has shape \(4, 2\), not batch 8"):
        load_inputs(tmp_path / "x.npz", 8)


def test_child_loads_what_the_parent_saves(tmp_path: Path) -> None:
    """The parent's saved model (an nn.Module whole, or TorchScript) loads in the child's
    loader; loaded on the CPU here, as the child would on `cuda:N`."""
    import torch

    from sidecar.profiling.gpu.ncu_child import load_model
    from tests.harness import models

    seq = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    x = torch.ones(2, 4)
    for model, name, saved_as in (
        (seq, "m.pt", "module"),
        (torch.jit.script(seq), "s.pt", "torchscript"),
    ):
        kind = ml._save_model(model, tmp_path / name)
        assert kind == saved_as
        args = ChildArgs(tmp_path / name, "cpu", Path("x.npz"), Path("r.json"), kind)
        assert torch.equal(load_model(torch, args)(x), seq(x))
    script = models.small_cnn_torchscript(tmp_path / "cnn.pt")
    args = ChildArgs(script, "cpu", Path("x.npz"), Path("r.json"))
    assert isinstance(load_model(torch, args), torch.jit.ScriptModule)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a model")
    with pytest.raises(ChildError, match="cannot load module model"):
        load_model(torch, ChildArgs(bad, "cpu", Path(), Path(), "module"))
    with pytest.raises(ChildError, match="model file not found"):
        load_model(torch, ChildArgs(tmp_path / "none.pt", "cpu", Path(), Path()))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU exists")
def test_child_without_cuda_exits_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sidecar.profiling.gpu.ncu_child import main

    argv = ["m.pt", "--device", "cuda:0", "--inputs", "x", "--result", str(tmp_path / "r")]
    assert main(argv) == 2
    assert capsys.readouterr().err == "ncu_child: CUDA is not available in the metrics child\n"
    assert not (tmp_path / "r").exists()


def test_ncu_kernels_match_the_cupti_forward_by_order_and_name(resnet_b8: Recording) -> None:
    ncu = read_ncu_csv(NCU_B8)
    kernels = _kernels(RecordingRunner(resnet_b8).kernel_iterations()[0])
    pairs = match_kernels(kernels, ncu)
    assert len(pairs) == len(kernels) == len(ncu) == 232
    cupti = [demangle(s.attributes.get("mangled_name", s.name)) for s, _ in pairs]
    for name, (_, prof) in zip(cupti, pairs, strict=True):  # equal after demangling
        assert base_name(name) == base_name(prof.name)
    assert sum(name != p.name for name, (_, p) in zip(cupti, pairs, strict=True)) > 100
    with pytest.raises(NcuJoinError, match="profiled 231 kernels but the forward ran 232"):
        match_kernels(kernels, ncu[:-1])
    swapped = list(ncu)
    i = next(i for i in range(231) if base_name(ncu[i].name) != base_name(ncu[i + 1].name))
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
    with pytest.raises(NcuJoinError, match=f"disagree at 2 of 232 launches .*launch {i},"):
        match_kernels(kernels, swapped)
    assert not any("dram_read_bytes" in k.attributes for k in kernels)  # nothing hung on


def test_scaled_units_are_brought_to_base_units() -> None:
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [
        '"0","k","dram__bytes_read.sum","Mbyte","4.83"',
        '"0","k","gpu__time_duration.sum","usecond","18.66"',
        '"0","k","sm__warps_active.avg.pct_of_peak_sustained_active","%","6.25"',
    ]
    (k,) = parse_ncu_csv(head + "\n".join(rows))
    assert k.metrics["dram__bytes_read.sum"] == pytest.approx(4.83e6)
    assert k.metrics["gpu__time_duration.sum"] == pytest.approx(18_660)
    assert k.metrics["sm__warps_active.avg.pct_of_peak_sustained_active"] == 6.25
    with pytest.raises(ProfilingError, match=r"unknown unit 'furlong' for dram__bytes_write\.sum"):
        parse_ncu_csv(head + '"0","k","dram__bytes_write.sum","furlong","1"')


FAKE_NCU = """\
#!{python}
# A fake `ncu` for tests: prints a real Nsight Compute CSV, writes the child's result file.
import gzip, json, os, subprocess, sys, time
argv = sys.argv[1:]
with open(os.environ["FAKE_NCU_ARGV"], "w") as fh:
    json.dump(argv, fh)
if os.environ.get("FAKE_NCU_PERMISSION"):  # what ncu prints without access to the counters
    print("==PROF== Connected to process 4242 (python3)")
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA "
          "GPU Performance Counters on the target device 0.")
    print("==PROF== Disconnected from process 4242")
    print("==WARNING== No kernels were profiled.")
    sys.exit(0)
if os.environ.get("FAKE_NCU_CHILD_PID"):  # the profiled process, still running
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.environ["FAKE_NCU_CHILD_PID"], "w") as fh:
        fh.write(str(child.pid))
time.sleep(float(os.environ.get("FAKE_NCU_SLEEP", "0")))
result = argv[argv.index("--result") + 1]
with open(result, "w") as fh:
    json.dump({{"forward_ns": 2_000_000_000, "warmup": 1}}, fh)
drop = os.environ.get("FAKE_NCU_DROP_ID")
for line in gzip.open(os.environ["FAKE_NCU_CSV"], "rt"):
    if drop is None or not line.startswith('"' + drop + '",'):
        sys.stdout.write(line)
"""


@pytest.fixture()
def fake_ncu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake `ncu` first on PATH; returns the file where it writes the argv it got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "ncu"
    tool.write_text(FAKE_NCU.format(python=sys.executable))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NCU_CSV", str(NCU_B8))
    monkeypatch.setenv("FAKE_NCU_ARGV", str(tmp_path / "argv.json"))
    return tmp_path / "argv.json"


def _k_run(rec: Recording) -> list[Iteration]:
    return [Iteration(0, spans) for spans in RecordingRunner(rec).kernel_iterations()]


def test_live_metrics_level_puts_ncu_metrics_on_every_k_iteration(
    fake_ncu: Path, resnet_b8: Recording, tmp_path: Path
) -> None:
    model = tmp_path / "resnet50.pt"
    model.write_bytes(b"not loaded by the fake")
    its = _k_run(resnet_b8)
    attrs = ml.live_metrics_level(ml.ModelSource(model), INPUTS, "cuda:0", its, warmup=3)
    assert (
        attrs["metrics_level"] == "captured: Nsight Compute (ncu, live), 232 kernels of one forward"
    )
    run = attrs["metrics_run"]
    assert (run["source"], run["kernels"], run["forward_ns"], run["warmup"]) == ("ncu", 232, 2e9, 3)
    assert run["wall_s"] > 0
    argv = json.loads(fake_ncu.read_text())
    child = argv[argv.index("-m") - 1 :]
    assert argv[: len(argv) - len(child)] == ncu_command("ncu", [])[1:]
    assert child[1:3] == ["-m", "sidecar.profiling.gpu.ncu_child"]
    args = parse_args(child[3:])
    assert (args.model, args.device, args.warmup, args.batch) == (model, "cuda:0", 3, 8)
    assert not args.inputs.exists()  # the temporary folder is gone
    ncu = read_ncu_csv(NCU_B8)
    for it in its:
        kernels = _kernels(it.spans)
        assert [k.attributes["ncu_kernel_id"] for k in kernels] == list(range(232))
        assert kernels[0].attributes["dram_read_bytes"] == 4_826_112
        assert all(k.attributes["metrics_source"] == "ncu" for k in kernels)
        layers = [s for s in it.spans if s.level is Level.LAYER and "kernel_flops" in s.attributes]
        total = sum(kernel_attributes(k)["flops"] for k in ncu)
        assert sum(s.attributes["kernel_flops"] for s in layers) == pytest.approx(total)
    ml.record_overhead(attrs, 5e6)
    assert run["overhead_ratio"] == pytest.approx(400.0)


def test_a_kernel_count_mismatch_fails_the_level_and_touches_nothing(
    fake_ncu: Path, resnet_b8: Recording, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NCU_DROP_ID", "231")
    its = _k_run(resnet_b8)
    attrs = ml.live_metrics_level(ml.ModelSource(NCU_B8), INPUTS, "cuda:0", its)
    assert attrs["metrics_level"] == (
        "not captured: the Nsight Compute run failed: Nsight Compute profiled 231 kernels but "
        "the forward ran 232: profile exactly one forward (warm-up excluded)"
    )
    assert "metrics_run" not in attrs
    assert not any("metrics_source" in s.attributes for it in its for s in it.spans)


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_an_ncu_run_past_its_timeout_fails_the_level_and_stops_what_it_profiled(
    fake_ncu: Path, resnet_b8: Recording, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_NCU_SLEEP", "30")
    monkeypatch.setenv("FAKE_NCU_CHILD_PID", str(pid_file))
    its = _k_run(resnet_b8)
    attrs = ml.live_metrics_level(ml.ModelSource(NCU_B8), INPUTS, "cuda:0", its, timeout_s=1.5)
    assert attrs["metrics_level"] == (
        "not captured: the Nsight Compute run failed: Nsight Compute did not finish within "
        "1.5 s (stopped, with the process it profiled)"
    )
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)  # the profiled process does not hold the GPU on


def test_the_reason_names_ncus_own_error(
    fake_ncu: Path, resnet_b8: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without access to the counters ncu lets the program run and exits 0 without a report:
    the stored reason must name the cause, not only "no header row"."""
    monkeypatch.setenv("FAKE_NCU_PERMISSION", "1")
    its = _k_run(resnet_b8)
    attrs = ml.live_metrics_level(ml.ModelSource(NCU_B8), INPUTS, "cuda:0", its)
    reason = attrs["metrics_level"]
    assert reason.startswith("not captured: the Nsight Compute run failed: ==ERROR== ERR_NVGPU")
    assert "NVreg_RestrictProfilingToAdminUsers=0" in reason and "no header row" in reason


def test_without_ncu_on_path_the_level_says_so(
    resnet_b8: Recording, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    its = _k_run(resnet_b8)
    attrs = ml.live_metrics_level(ml.ModelSource(NCU_B8), INPUTS, "cuda:0", its)
    assert attrs == {"metrics_level": ml.NCU_NOT_ON_PATH, "pm_sampling": ml.PM_SAMPLING}
    assert attrs["metrics_level"] == "not captured: ncu not on PATH: metrics level not captured"
    ml.record_overhead(attrs, 5e6)  # nothing to record
    assert "metrics_run" not in attrs


def test_a_module_that_cannot_be_pickled_fails_the_level(
    fake_ncu: Path, resnet_b8: Recording
) -> None:
    from tests.harness import models

    its = _k_run(resnet_b8)
    local_class = models.small_cnn_torch()  # its class is defined inside a function
    attrs = ml.live_metrics_level(ml.ModelSource(model=local_class), INPUTS, "cuda:0", its)
    assert attrs["metrics_level"].startswith(
        "not captured: the Nsight Compute run failed: the model cannot be saved for the "
        "metrics child"
    )
    assert "define its class at module level" in attrs["metrics_level"]


GPU_AND_NCU = pytest.mark.skipif(
    not (__import__("torch").cuda.is_available() and shutil.which("ncu")),
    reason="needs a CUDA GPU and Nsight Compute (ncu) on PATH",
)


@GPU_AND_NCU
def test_live_metrics_level_on_a_gpu(tmp_path: Path) -> None:  # pragma: no cover - GPU only
    from sidecar.profiling.experiment import run_experiment
    from sidecar.profiling.gpu.owner import PROCESS_OWNER
    from sidecar.profiling.runners.pytorch import PyTorchRunner
    from tests.harness import models

    if PROCESS_OWNER.owner not in (None, "CuptiTracer"):
        pytest.skip("torch.profiler already used CUPTI in this process")
    path = models.small_cnn_torchscript(tmp_path / "small_cnn.pt")
    runner = PyTorchRunner(path, device="cuda", ncu_metrics=True)
    x = {"input": np.random.default_rng(0).random((8, 3, 32, 32), dtype=np.float32)}
    res = run_experiment(runner, x, model="cnn", iterations=3, warmup=2)
    attrs = res.trace.attributes
    assert attrs["metrics_level"].startswith("captured: Nsight Compute (ncu, live)"), attrs
    assert attrs["metrics_run"]["overhead_ratio"] > 1
    kernels = [s for s in res.spans_at(Level.KERNEL) if s.kind == "kernel"]
    assert kernels and all(k.attributes["metrics_source"] == "ncu" for k in kernels)
    assert all("dram_read_bytes" in k.attributes for k in kernels)


def test_the_metrics_level_is_asked_for_never_run_by_default(tmp_path: Path) -> None:
    """`ncu` reruns the model (minutes for a large one): only `--ncu-metrics` asks for it, and
    only PyTorch on a CUDA device has it; a K run without it says it was not requested."""
    from sidecar.profiling.runners.select import runner_for
    from tests.harness import models

    assert ml.not_requested_status() == {
        "metrics_level": ml.NCU_NOT_REQUESTED,
        "pm_sampling": ml.PM_SAMPLING,
    }
    path = models.small_cnn_torchscript(tmp_path / "small_cnn.pt")
    with pytest.raises(ProfilingError, match=r"--ncu-metrics.*PyTorch models on a CUDA device"):
        runner_for(path, ncu_metrics=True)  # the CPU
