"""Nsight Compute import, GPU peaks, demangling, the CUPTI owner guard and innermost
containment (no GPU needed; the ncu CSV is a real H100 report, see gpu-fixtures/README)."""

from __future__ import annotations

import pytest

from sidecar.profiling.containment import assign_parents
from sidecar.profiling.gpu.demangle import base_name, demangle, short_name
from sidecar.profiling.gpu.gpu_peak import datasheet, datasheet_peak
from sidecar.profiling.gpu.ncu import (
    NcuJoinError,
    join_metrics,
    kernel_attributes,
    read_ncu_csv,
    run_ncu,
)
from sidecar.profiling.gpu.owner import CuptiOwner, CuptiOwnerError
from sidecar.profiling.gpu.recording import Recording, RecordingRunner
from sidecar.profiling.vocabulary import LevelNotSupportedError
from sidecar.trace.spans import Level, Source, Span
from tests.gpu.conftest import NCU_B8


def test_ncu_csv_totals_match_the_readme() -> None:
    kernels = read_ncu_csv(NCU_B8)
    assert len(kernels) == 232
    tot = {
        m: sum(k.metrics[m] for k in kernels)
        for m in ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
                  "sm__inst_executed_pipe_tensor.sum")
    }  # fmt: skip
    assert tot["gpu__time_duration.sum"] / 1e6 == pytest.approx(2.20, abs=0.005)
    dram = tot["dram__bytes_read.sum"] + tot["dram__bytes_write.sum"]
    assert dram / 1e9 == pytest.approx(1.82, abs=0.005)
    assert tot["sm__inst_executed_pipe_tensor.sum"] / 1e6 == pytest.approx(21.4, abs=0.05)
    fp32 = sum(kernel_attributes(k)["flops_fp32"] for k in kernels)
    assert fp32 / 1e9 == pytest.approx(0.86, abs=0.005)
    first = kernel_attributes(kernels[0])
    assert first["metrics_source"] == "ncu" and first["dram_read_bytes"] == 4_826_112
    # its FLOPs include tensor-pipe instructions converted at an assumed shape: estimated
    assert first["tensor_pipe_instructions"] == 100_352 and first["metrics_estimated"] is True
    assert "undercounted" in first["estimated_because"]
    attrs = [kernel_attributes(k) for k in kernels]
    with_tensor = [a for a in attrs if a.get("tensor_pipe_instructions", 0) > 0]
    assert len(with_tensor) == 63 and all(a["metrics_estimated"] for a in with_tensor)
    assert not any(a["metrics_estimated"] for a in attrs if a not in with_tensor)
    assert 0 < first["achieved_occupancy"] <= 1


def test_ncu_joins_the_cupti_kernels_of_one_forward(resnet_b8: Recording) -> None:
    ncu = read_ncu_csv(NCU_B8)
    spans = RecordingRunner(resnet_b8).kernel_iterations()[0]
    kernels = [s for s in spans if s.kind == "kernel"]
    assert join_metrics(kernels, ncu) == 232
    assert all("dram_read_bytes" in k.attributes for k in kernels)
    first = min(kernels, key=lambda s: s.start_ns)
    assert first.attributes["ncu_kernel_id"] == 0
    with pytest.raises(NcuJoinError, match="profiled 231 kernels but the forward ran 232"):
        join_metrics(kernels, ncu[1:])
    with pytest.raises(NcuJoinError, match="names disagree"):
        join_metrics(kernels, list(reversed(ncu)))


def test_run_ncu_without_ncu_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LevelNotSupportedError, match="`ncu`\\) is not on PATH"):
        run_ncu(["python", "-c", "pass"])


def test_gpu_datasheet_peaks() -> None:
    h100 = datasheet_peak("NVIDIA H100 80GB HBM3")
    assert h100.peak.flops_per_s == pytest.approx(66.9e12)
    assert h100.peak.dram_bytes_per_s == pytest.approx(3.35e12)
    assert h100.peak.source.startswith("gpu-spec (fp32")
    assert datasheet_peak("NVIDIA H100 80GB HBM3", "tf32").peak.flops_per_s == pytest.approx(
        494.7e12
    )
    assert datasheet("NVIDIA H200").dram_bytes_per_s == pytest.approx(4.8e12)  # type: ignore[union-attr]
    assert datasheet("NVIDIA H100 PCIe").dram_bytes_per_s == pytest.approx(2.0e12)  # type: ignore[union-attr]
    assert datasheet("Tesla T4") is None
    assert datasheet("NVIDIA GH200 480GB") is None  # not the H200's 4.8 TB/s
    assert datasheet("NVIDIA H200 NVL") is None  # not the SXM part's roofs
    assert datasheet("NVIDIA H100 80GB HBM3 MIG 1g.10gb") is None  # a slice of the part
    attrs = h100.trace_attributes()
    assert attrs["peak_source"].startswith("gpu-spec")
    assert attrs["peak_datasheet"]["tf32_tensor_flops_per_s"] == pytest.approx(494.7e12)


def test_demangled_names() -> None:
    mangled = (
        "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEv"
        "iT0_T1_"
    )
    full = demangle(mangled)
    assert full.startswith("void at::native::vectorized_elementwise_kernel<4, at::native::")
    assert short_name(mangled) == "at::native::vectorized_elementwise_kernel<…>"
    assert base_name(mangled) == "vectorized_elementwise_kernel"
    assert demangle("sm80_xmma_fprop_tf32") == "sm80_xmma_fprop_tf32"  # extern "C"
    pool = "void at::native::(anonymous namespace)::max_pool_forward_nchw<float, float>(int)"
    assert short_name(pool) == "at::native::(anonymous namespace)::max_pool_forward_nchw<…>"


def test_one_cupti_owner_per_process() -> None:
    owner = CuptiOwner()
    owner.claim("torch.profiler")
    owner.claim("torch.profiler")  # the same client again is fine
    with pytest.raises(CuptiOwnerError, match=r"torch\.profiler already used CUPTI"):
        owner.claim("CuptiTracer")


def test_cupti_tracer_claims_the_process_owner() -> None:
    from sidecar.profiling.gpu.cupti_tracer import CuptiTracer

    owner = CuptiOwner()
    owner.claim("torch.profiler")
    with pytest.raises(CuptiOwnerError):
        CuptiTracer(owner=owner).start()


def _span(sid: str, level: Level, start: int, end: int, **attrs: object) -> Span:
    return Span("t" * 32, sid, None, level, sid, "x", start, end, Source.REPLAY,
                attributes=dict(attrs))  # fmt: skip


def test_innermost_of_nested_layers_is_the_parent() -> None:
    spans = [
        _span("m", Level.MODEL, 0, 100),
        _span("layer1", Level.LAYER, 10, 90, depth=1),
        _span("layer1.0", Level.LAYER, 20, 80, depth=2),
        _span("layer1.0.conv", Level.LAYER, 30, 40, depth=3),
        _span("p1", Level.LAYER, 91, 96),
        _span("p2", Level.LAYER, 92, 99),  # overlaps p1 without nesting: parallel layers
        _span("launch_conv", Level.KERNEL, 31, 32),
        _span("launch_add", Level.KERNEL, 50, 51),  # between children: the container's
        _span("launch_parallel", Level.KERNEL, 93, 94),
    ]
    assign_parents(spans)
    by = {s.span_id: s for s in spans}
    assert by["launch_conv"].parent_id == "layer1.0.conv"
    assert by["launch_add"].parent_id == "layer1.0"
    assert by["launch_parallel"].parent_id is None
    assert by["launch_parallel"].attributes["parent_ambiguous"] is True


def test_metrics_level_says_why_it_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.profiling.gpu import metrics_level as ml

    monkeypatch.setenv("PATH", "/nonexistent")
    assert ml.live_status() == {"metrics_level": ml.NCU_NOT_ON_PATH, "pm_sampling": ml.PM_SAMPLING}
    assert ml.NCU_NOT_ON_PATH == "not captured: ncu not on PATH: metrics level not captured"
    assert ml.PM_SAMPLING.startswith("not captured: cupti-python PM sampling")


def test_ncu_metrics_are_summed_per_layer(resnet_b8: Recording) -> None:
    ncu = read_ncu_csv(NCU_B8)
    runner = RecordingRunner(resnet_b8, ncu=ncu)
    run = runner.run({}, Level.KERNEL, 3, 0)
    assert run.attributes["metrics_level"].startswith("captured: Nsight Compute")
    assert run.attributes["pm_sampling"].startswith("not captured")
    spans = run.iterations[0].spans
    layers = [s for s in spans if s.level is Level.LAYER and "kernel_flops" in s.attributes]
    total = sum(kernel_attributes(k)["flops"] for k in ncu)
    assert sum(s.attributes["kernel_flops"] for s in layers) == pytest.approx(total)
    dram = sum(kernel_attributes(k)["dram_read_bytes"] for k in ncu)
    assert sum(s.attributes["kernel_dram_read_bytes"] for s in layers) == pytest.approx(dram)
    assert {s.attributes["kernel_metrics_source"] for s in layers} == {"ncu"}
    estimated = {s.name for s in layers if s.attributes["kernel_metrics_estimated"]}
    assert "conv1" in estimated and "layer1.0.conv2" in estimated  # tensor-pipe convolutions
    assert "layer1.0.bn1" not in estimated and "maxpool" not in estimated
    assert len(layers) == 158 + 16  # leaves with kernels, and 16 Bottlenecks' residual adds
    plain = RecordingRunner(resnet_b8).run({}, Level.KERNEL, 3, 0)
    assert plain.attributes["metrics_level"] == (
        "not captured: no Nsight Compute CSV was given with the recording"
    )


def test_a_trace_whose_kernels_ran_on_the_tensor_pipe_gets_the_tensor_roof(
    resnet_b8: Recording,
) -> None:
    """Live and recorded GPU traces pick their roof the same way (`roof_attributes`)."""
    from sidecar.profiling.gpu.gpu_peak import GpuPeak, roof_attributes
    from sidecar.profiling.peak import Peak

    measured = GpuPeak(
        Peak(51.0e12, 3.0e12, "gpu-microbenchmark", "NVIDIA H100 80GB HBM3", 1),
        datasheet("NVIDIA H100 80GB HBM3"),
    )
    with_ncu = RecordingRunner(resnet_b8, ncu=read_ncu_csv(NCU_B8)).run({}, Level.KERNEL, 3, 0)
    attrs = roof_attributes(measured, with_ncu.iterations[0].spans)
    assert attrs["peak_flops_per_s"] == pytest.approx(494.7e12)
    assert attrs["peak_source"].startswith("gpu-spec (tf32, ")
    assert attrs["peak_measured"]["peak_flops_per_s"] == 51.0e12
    plain = RecordingRunner(resnet_b8).run({}, Level.KERNEL, 3, 0)
    attrs = roof_attributes(measured, plain.iterations[0].spans)
    assert attrs["peak_flops_per_s"] == 51.0e12 and "peak_measured" not in attrs
