"""A model no replay can run yields a live-only trace, end to end: the real Triton (in
OpenTelemetry trace mode, pointed at the sidecar's OTLP receiver) serves the sample `add_sub`, a
Python-backend model with only its `model.py`, which the sidecar is told not to run
(`--replay-python-models off`); the real `xsp-sidecar serve` samples it under its
rate and budget, stores the relay's and Triton's spans under a `live_only` trace row without
giving its worker a job, and `analysis/report.py` reads the store."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from analysis import report
from sidecar.trace.spans import Level, Source
from sidecar.trace.store import TraceStore
from tests.e2e.helpers import cnn_infer, wait_until
from tests.harness.metrics_text import samples
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def add_sub(
    client: grpcclient.InferenceServerClient, headers: dict[str, str] | None = None
) -> None:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [4], "FP32")
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32))
        inputs.append(tensor)
    result = client.infer("add_sub", inputs, headers=headers)
    assert result.as_numpy("OUTPUT0").tolist() == [0.0, 2.0, 4.0, 6.0]


def test_a_model_no_replay_can_run_yields_live_only_traces_the_report_reads(
    traced_triton: TritonServer, tmp_path: Path, otlp_port: int
) -> None:
    db = tmp_path / "traces.db"
    args = [
        "--model-repository", str(traced_triton.model_repository), "--db", str(db),
        "--otlp-port", str(otlp_port), "--sample-rate", "1", "--sample-budget", "4",
        "--duty-cycle", "0.05", "--iterations", "2", "--warmup", "0", "--levels", "M",
        "--replay-python-models", "off",
    ]  # fmt: skip
    proc = SidecarProcess(traced_triton.grpc_address, tmp_path / "sidecar.log", args=args)
    with proc:
        client = grpcclient.InferenceServerClient(proc.address)
        for _ in range(3):  # rate 1: taken under the budget, one after the other
            add_sub(client)
        add_sub(client, headers={"x-xsp-profile": "1"})  # the budget's last token
        add_sub(client, headers={"x-xsp-profile": "1"})  # the budget is spent
        store = TraceStore(db)

        def live_only() -> list[str]:
            return [t.trace_id for t in store.list_traces() if t.status == "live_only"]

        def with_backend_spans() -> list[str]:
            return [t for t in live_only()
                    if any(s.source is Source.BACKEND for s in store.spans(t))]  # fmt: skip

        assert wait_until(lambda: len(live_only()) == 4, 60), proc.log_tail()
        # Triton 2.51 now and then exports no trace at all (see tests/live/; in CI runs under
        # load one of the four missed 30 s): half of them joined is what this test needs
        assert wait_until(lambda: len(with_backend_spans()) >= 2, 120), proc.log_tail()
        profiles = {
            s.labels["outcome"]: s.value
            for s in samples(proc.metrics())
            if s.name == "xsp_profiles_total" and s.labels["model"] == "add_sub"
        }
        assert profiles == {"live_only": 4.0}, profiles  # no `error`, nothing else
        decisions = "xsp_sampling_decisions_total"
        assert proc.metric(decisions, model="add_sub", decision="sampled") == 4
        assert proc.metric(decisions, model="add_sub", decision="skipped_budget") == 1
        assert proc.metric("xsp_sampled_total", model="add_sub") == 0  # no job was queued
        # the worker is free for a model it can replay, at once (no duty-cycle share taken)
        cnn_infer(client, headers={"x-xsp-profile": "1"})
        assert wait_until(lambda: proc.metric("xsp_profiles_total", outcome="ok") == 1, 90)
    for trace_id in live_only():
        trace = store.get_trace(trace_id)
        assert trace is not None and trace.model == "add_sub" and trace.error == ""
        assert trace.attributes["replay"] == (
            "not_replayable: model 'add_sub' is a Python-backend model (its model.py): "
            "--replay-python-models is off"
        )
        assert trace.sample_reason in ("rate", "forced") and trace.batch_size is None
        spans = store.spans(trace_id)
        (request,) = [s for s in spans if s.level is Level.REQUEST]
        assert request.span_id == trace.attributes["request_span_id"]
        assert request.attributes["model"] == "add_sub" and request.attributes["grpc_code"] == "OK"
        assert not [s for s in spans if s.source is Source.REPLAY]
    traced = with_backend_spans()[0]
    assembled = store.get_trace(traced)
    assert assembled is not None and assembled.attributes["assembly"] == {
        "state": "incomplete",  # whole but for the replay, which is named
        "missing": ["replay"],
        "why": f"replay: {assembled.attributes['replay']}",
    }
    kinds = {s.kind for s in store.spans(traced) if s.source is Source.BACKEND}
    assert {"request", "queue", "compute_input", "compute_infer", "compute_output"} <= kinds
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert report.main([str(db), "--model", "add_sub", "--format", "json"]) == 0, err
    doc = json.loads(out.getvalue())
    assert doc["meta"]["traces"] == 4 and "failed_profiles_skipped" not in doc["meta"]
    rows = {r["phase"]: r for r in doc["live_breakdown"]["rows"] if r["model"] == "add_sub"}
    assert rows["client_total"]["requests"] == 4
    assert rows["compute_infer"]["requests"] == len(with_backend_spans())
    assert not [k for k, v in doc.items() if isinstance(v, dict) and v.get("status") == "error"]
