"""The `xsp.v1.Profiler` admin API of a real `xsp-sidecar serve` process."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from sidecar.admin._proto.xsp.v1 import profiler_pb2, profiler_pb2_grpc
from tests.e2e.helpers import cnn_infer, wait_until
from tests.harness.process import free_port
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton]


def test_admin_api_triggers_lists_and_tunes(triton: TritonServer, tmp_path: Path) -> None:
    admin_port = free_port()
    proc = SidecarProcess(
        backend=triton.grpc_address, log_path=tmp_path / "sidecar.log",
        args=["--model-repository", str(triton.model_repository), "--db",
              str(tmp_path / "traces.db"), "--otlp-port", "0", "--sample-rate", "0",
              "--duty-cycle", "1", "--iterations", "3", "--warmup", "1", "--admin",
              "--admin-listen", f"127.0.0.1:{admin_port}"],
    )  # fmt: skip
    with proc, grpc.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
        admin = profiler_pb2_grpc.ProfilerStub(channel)

        # no request seen yet: random inputs shaped by config.pbtxt
        first = admin.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="simple_cnn"))
        assert first.accepted and first.input_source == "random" and len(first.trace_id) == 32

        # given inputs
        x = np.ones((3, 3, 32, 32), np.float32)
        tensor = profiler_pb2.InputTensor(
            name="input", datatype="FP32", shape=list(x.shape), raw_contents=x.tobytes()
        )
        given = admin.TriggerProfile(
            profiler_pb2.TriggerProfileRequest(model="simple_cnn", inputs=[tensor])
        )
        assert given.accepted and given.input_source == "given"

        # after a sampled live request, the last request is reused
        cnn_infer(grpcclient.InferenceServerClient(proc.address), batch=4,
                  headers={"x-xsp-profile": "1"})  # fmt: skip
        assert wait_until(lambda: proc.metric("xsp_profiles_total", outcome="ok") == 3, 90)
        last = admin.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="simple_cnn"))
        assert last.input_source == "last_request"
        assert wait_until(lambda: proc.metric("xsp_profiles_total", outcome="ok") == 4, 90)

        listed = admin.ListTraces(profiler_pb2.ListTracesRequest(model="simple_cnn")).traces
        by_id = {t.trace_id: t for t in listed}
        assert len(listed) == 4
        assert by_id[first.trace_id].batch_size == 1 and by_id[given.trace_id].batch_size == 3
        assert (
            by_id[last.trace_id].batch_size == 4 and by_id[last.trace_id].sample_reason == "admin"
        )
        assert all(t.model_latency_ns > 0 and t.status == "ok" for t in listed)

        # read and change sampling at run time
        assert admin.GetSampling(profiler_pb2.GetSamplingRequest()).rate == 0
        updated = admin.UpdateSampling(
            profiler_pb2.UpdateSamplingRequest(rate=1.0, model_rates={"add_sub": 0.5})
        )
        assert updated.rate == 1.0 and dict(updated.model_rates) == {"add_sub": 0.5}
        assert updated.budget_per_minute == 6  # untouched
        cnn_infer(grpcclient.InferenceServerClient(proc.address))
        assert proc.metric("xsp_sampling_decisions_total", decision="sampled") == 2

        with pytest.raises(grpc.RpcError) as bad:
            admin.UpdateSampling(profiler_pb2.UpdateSamplingRequest(rate=2.0))
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "[0, 1]" in (bad.value.details() or "")
        with pytest.raises(grpc.RpcError) as missing:
            admin.TriggerProfile(profiler_pb2.TriggerProfileRequest())
        assert missing.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_admin_api_is_off_unless_enabled(triton: TritonServer, tmp_path: Path) -> None:
    admin_port = free_port()
    proc = SidecarProcess(
        backend=triton.grpc_address, log_path=tmp_path / "sidecar.log",
        args=["--model-repository", str(triton.model_repository), "--db",
              str(tmp_path / "traces.db"), "--otlp-port", "0",
              "--admin-listen", f"127.0.0.1:{admin_port}"],
    )  # fmt: skip
    with proc, grpc.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
        admin = profiler_pb2_grpc.ProfilerStub(channel)
        with pytest.raises(grpc.RpcError) as off:
            admin.GetSampling(profiler_pb2.GetSamplingRequest(), timeout=2)
        assert off.value.code() is grpc.StatusCode.UNAVAILABLE


def test_admin_trigger_of_a_model_no_replay_can_run_is_refused(
    triton: TritonServer, tmp_path: Path
) -> None:
    admin_port = free_port()
    proc = SidecarProcess(
        backend=triton.grpc_address, log_path=tmp_path / "sidecar.log",
        args=["--model-repository", str(triton.model_repository), "--db",
              str(tmp_path / "traces.db"), "--otlp-port", "0", "--sample-rate", "0",
              "--replay-python-models", "off", "--admin",
              "--admin-listen", f"127.0.0.1:{admin_port}"],
    )  # fmt: skip
    with proc, grpc.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
        admin = profiler_pb2_grpc.ProfilerStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            admin.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="add_sub"))
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        details = refused.value.details() or ""
        assert "model 'add_sub' cannot be profiled: no replay can run it" in details
        assert "--replay-python-models is off" in details
        assert proc.metric("xsp_profiles_total") == 0  # no job, no error trace
