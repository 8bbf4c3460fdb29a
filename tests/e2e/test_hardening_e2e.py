"""Hardening of sampling, end to end: a real `xsp-sidecar serve` in front of the real Triton.

Client-chosen model names cannot grow labels or memory; a trace store that cannot be opened,
or that fills up at run time, switches sampling off or backs it off while requests are still
relayed.
"""

from __future__ import annotations

import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.e2e.helpers import cnn_infer, wait_until
from tests.harness.metrics_text import families
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton]

SAMPLING_METRICS = (
    "xsp_sampling_decisions",
    "xsp_samples_dropped",
    "xsp_profiles",
    "xsp_profiled_latency_seconds",
    "xsp_profiling_overhead_ratio",
    "xsp_layer_type_time_share",
)


def sidecar(triton: TritonServer, tmp_path: Path, db: Path, *args: str) -> SidecarProcess:
    return SidecarProcess(
        backend=triton.grpc_address, log_path=tmp_path / "sidecar.log",
        args=["--model-repository", str(triton.model_repository), "--db", str(db),
              "--otlp-port", "0", "--iterations", "1", "--warmup", "0", *args],
    )  # fmt: skip


def model_labels(proc: SidecarProcess, names: tuple[str, ...]) -> set[str]:
    labels: set[str] = set()
    for family in families(proc.metrics()):
        if family.name in names:
            labels.update(s.labels["model"] for s in family.samples if "model" in s.labels)
    return labels


def health(proc: SidecarProcess, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{proc.grpc_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def infer_unknown(client: grpcclient.InferenceServerClient, model: str) -> None:
    x = grpcclient.InferInput("input", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer(model, [x], headers={"x-xsp-profile": "1"})


def test_made_up_models_neither_grow_labels_nor_memory(
    triton: TritonServer, tmp_path: Path
) -> None:
    args = ["--max-models", "3", "--sample-rate", "1", "--sample-budget", "10000",
            "--duty-cycle", "1", "--queue-size", "64"]  # fmt: skip
    with sidecar(triton, tmp_path, tmp_path / "traces.db", *args) as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        cnn_infer(client, headers={"x-xsp-profile": "1"})
        made_up = [f"no-such-model-{n}" for n in range(10)] + ["x" * 10_000, "nul\0name"]
        for model in made_up:
            infer_unknown(client, model)
        sampled = 1 + len(made_up)
        assert wait_until(
            lambda: proc.metric("xsp_sampling_decisions_total", decision="sampled") == sampled, 30
        ), proc.log()
        # a name longer than the relay reads (1 KB) leaves the sample unreadable: dropped
        assert wait_until(
            lambda: (
                proc.metric("xsp_profiles_total") + proc.metric("xsp_samples_dropped_total")
                == sampled
            ),
            120,
        ), proc.metrics()
        relay_labels = model_labels(proc, ("xsp_requests",))
        sampling_labels = model_labels(proc, SAMPLING_METRICS)
        assert len(relay_labels) <= 3 + 2  # the cap, `_other`, `_unknown`
        assert "simple_cnn" in sampling_labels and "_other" in sampling_labels
        assert sampling_labels <= relay_labels
        # models the repository does not have are never replayed (nor queued with their bodies)
        assert proc.metric("xsp_samples_dropped_total", reason="unknown_model") >= len(made_up) - 1
        assert proc.metric("xsp_profiles_total", outcome="error") == 0
        # only the real model's last request is kept for the admin API
        kept = proc.metric("xsp_last_request_bytes")
        assert 0 < kept < 20_000, kept


def test_a_store_that_cannot_be_opened_leaves_forwarding_on(
    triton: TritonServer, tmp_path: Path
) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("a regular file, so nothing can be created under it (even by root)")
    args = ["--sample-rate", "1", "--duty-cycle", "1"]
    with sidecar(triton, tmp_path, not_a_dir / "traces.db", *args) as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        for _ in range(5):
            cnn_infer(client, headers={"x-xsp-profile": "1"})
        assert proc.metric("xsp_requests_total", model="simple_cnn", grpc_code="OK") == 5
        assert proc.metric("xsp_sampling_enabled") == 0
        assert proc.metric("xsp_sampling_disabled", reason="store_unavailable") == 1
        assert proc.metric("xsp_sampling_disabled", reason="store_failing") == 0
        assert proc.metric("xsp_sampling_decisions_total") == 0
        assert health(proc, "") == health_pb2.HealthCheckResponse.SERVING  # pod stays ready
        assert health(proc, "xsp.sampling") == health_pb2.HealthCheckResponse.NOT_SERVING
        log = proc.log_path.read_text()
        assert log.count("sampling is off") == 1, log
        assert str(not_a_dir) in log


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MB tmpfs (needs the right to mount, e.g. root in a container)."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` until the disk is full."""
    filler = directory / "filler"
    with filler.open("wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_a_full_disk_backs_sampling_off_with_a_quiet_log(
    triton: TritonServer, tmp_path: Path, tiny_fs: Path
) -> None:
    args = ["--sample-rate", "0", "--sample-budget", "10000", "--duty-cycle", "1",
            "--queue-size", "64"]  # fmt: skip
    with sidecar(triton, tmp_path, tiny_fs / "traces.db", *args) as proc:
        client = grpcclient.InferenceServerClient(proc.address)
        forced = {"x-xsp-profile": "1"}
        cnn_infer(client, headers=forced)
        assert wait_until(lambda: proc.metric("xsp_profiles_total", outcome="ok") == 1, 90)
        log_before = len(proc.log_path.read_text().splitlines())

        filler = fill(tiny_fs)
        calls = 0
        for _ in range(300):
            cnn_infer(client, headers=forced)
            calls += 1
            time.sleep(0.005)  # the worker profiles in the serving path's quiet moments
        assert wait_until(lambda: proc.metric("xsp_profile_queue_depth") == 0, 120)
        assert proc.metric("xsp_requests_total", grpc_code="OK") == 1 + calls
        skipped = proc.metric("xsp_sampling_decisions_total", decision="skipped_store_failing")
        sampled = proc.metric("xsp_sampling_decisions_total", decision="sampled")
        store_errors = proc.metric("xsp_profiles_total", outcome="store_error")
        assert store_errors >= 1, proc.log()
        assert skipped > 0 and sampled + skipped == 1 + calls
        # profiles that ran into the full disk: far fewer than the samples taken
        assert store_errors < sampled
        failure_log = proc.log_path.read_text().splitlines()[log_before:]
        assert sum("Traceback" in line for line in failure_log) <= 2, "\n".join(failure_log)
        assert len(failure_log) < 60, "\n".join(failure_log)

        # A write can still succeed now and then on a full disk (SQLite reuses pages that
        # retention freed), and any success reopens the store; so ask while samples keep
        # coming instead of reading one instant after the queue drained.
        def sampling_not_serving() -> bool:
            cnn_infer(client, headers=forced)
            return health(proc, "xsp.sampling") == health_pb2.HealthCheckResponse.NOT_SERVING

        assert wait_until(sampling_not_serving, 30, interval=0.5), proc.log()
        assert health(proc, "") == health_pb2.HealthCheckResponse.SERVING

        filler.unlink()  # space again: sampling comes back by itself

        def profiled_again() -> bool:
            cnn_infer(client, headers=forced)
            return proc.metric("xsp_profiles_total", outcome="ok") >= 2

        assert wait_until(profiled_again, 120, interval=0.5), proc.log()
        assert wait_until(
            lambda: health(proc, "xsp.sampling") == health_pb2.HealthCheckResponse.SERVING, 30
        )
