"""The OTLP export of stored traces, against real receivers that decode the OTLP protobuf.

OTLP/HTTP: the sidecar's own receiver (`OtlpReceiver`, a real OTLP decoder) plays the
Collector. OTLP/gRPC: a grpcio server with opentelemetry-proto's TraceService, whose requests
are decoded by the same parser. The traces go through the real path: the sampling pipeline's
trace writer commits the live spans, the "worker" (a second store on the same SQLite file)
commits the replay part, and what the store holds is what arrives.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

from sidecar.backends.replayability import Replayability
from sidecar.live.otlp_payload import OtlpSpan, parse_otlp_protobuf
from sidecar.live.otlp_receiver import OtlpReceiver
from sidecar.replay.job_records import JobResult, ProfileJob
from sidecar.sampling.pipeline import SamplingPipeline
from sidecar.trace.otlp_export import OtlpExportCollector, OtlpTraceExport, make_exporter
from sidecar.trace.otlp_target import OtlpExportError, parse_target
from sidecar.trace.spans import Level, LevelStats, Source, Span, Trace
from sidecar.trace.store import TraceStore
from sidecar.trace.writer import TraceWriter
from tests.harness.metrics_text import sample_value, scrape_registry
from tests.harness.traces.synthetic import Ids, make_trace
from tests.sampling.test_pipeline import model_label, sampling_config


class Received:
    """Spans a receiver decoded, waited for by count."""

    def __init__(self) -> None:
        self.spans: list[OtlpSpan] = []
        self._cond = threading.Condition()

    def add(self, spans: list[OtlpSpan]) -> None:
        with self._cond:
            self.spans.extend(spans)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 15.0) -> list[OtlpSpan]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.spans) >= count, timeout)
            return list(self.spans)


@pytest.fixture
def http_collector() -> Iterator[tuple[OtlpReceiver, Received]]:
    received = Received()
    with OtlpReceiver(received.add, port=0) as receiver:
        yield receiver, received


class GrpcTraceService(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC TraceService that decodes each request with the receiver's parser."""

    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        self.received.add(parse_otlp_protobuf(request.SerializeToString()))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_collector() -> Iterator[tuple[int, Received]]:
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(GrpcTraceService(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, received
    server.stop(0)


def free_port() -> int:
    """A port nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_trace(seed: int = 7) -> tuple[Span, list[Span], Trace, list[LevelStats]]:
    """A stored trace split as the sidecar stores it: the proxy's span, the replay part."""
    trace, spans, stats = make_trace(layers=3, kernels_per_layer=2, ids=Ids(random.Random(seed)))
    request = next(s for s in spans if s.source is Source.PROXY)
    return request, [s for s in spans if s is not request], trace, stats


def check_tree(received: Sequence[OtlpSpan], stored: Sequence[Span]) -> None:
    """Same ids, parent links and timestamps as stored; every span once."""
    by_id = {s.span_id: s for s in received}
    assert len(by_id) == len(received) == len(stored)
    for span in stored:
        got = by_id[span.span_id]
        assert got.trace_id == span.trace_id
        assert got.parent_span_id == span.parent_id
        assert (got.start_ns, got.end_ns) == (span.start_ns, span.end_ns)
        assert got.name == span.name
        assert got.attributes["xsp.level"] == span.level.value
        assert got.attributes["xsp.source"] == span.source.value
        assert got.resource["service.name"] == "xsp-sidecar"


def test_a_stored_trace_reaches_an_otlp_http_collector_whole(
    http_collector: tuple[OtlpReceiver, Received], tmp_path: Path
) -> None:
    receiver, received = http_collector
    repository = tmp_path / "models"
    (repository / "resnet50" / "1").mkdir(parents=True)
    config = replace(
        sampling_config(repository, tmp_path / "traces.db"),
        otlp_export=f"http://127.0.0.1:{receiver.port}/v1/traces",
    )
    registry = CollectorRegistry()
    pipeline = SamplingPipeline(config, registry, model_label)
    request, replay, trace, stats = worker_trace()
    try:
        assert pipeline.export is not None
        assert pipeline.store_spans(request.trace_id, [request])  # the relay's span
        with TraceStore(tmp_path / "traces.db") as worker_store:  # the worker process's write
            worker_store.write_trace(trace, replay, stats)
        pipeline._on_result(JobResult(request.trace_id, "resnet50", "ok", 0.1))
        assert pipeline.writer is not None and pipeline.writer.flush(10)
        assert pipeline.export.flush(10)
        got = received.wait_for(len(replay) + 1)
    finally:
        pipeline.stop()
    check_tree(got, [request, *replay])
    by_id = {s.span_id: s for s in got}
    model = next(s for s in replay if s.level is Level.MODEL)
    assert by_id[request.span_id].parent_span_id is None  # the root: the proxy's span
    assert by_id[model.span_id].parent_span_id == request.span_id
    attrs = by_id[model.span_id].attributes
    assert attrs["xsp.model"] == "resnet50" and attrs["xsp.batch_size"] == 1
    assert attrs["xsp.run_level"] == "model" and attrs["xsp.duration_ns"] == 7_500_000
    for stat in stats:
        assert attrs[f"xsp.overhead_ratio.{stat.level.value}"] == stat.overhead_ratio
        assert attrs[f"xsp.latency_ns.{stat.level.value}"] == stat.trimmed_mean_ns
    layer = next(s for s in replay if s.level is Level.LAYER)
    layer_attrs = by_id[layer.span_id].attributes
    assert layer_attrs["xsp.flops"] == 118_013_952.0 and layer_attrs["xsp.flops_estimated"] is True
    assert layer_attrs["xsp.input_shapes"] == "[[1,3,224,224],[64,3,7,7]]"  # nested: JSON
    assert by_id[request.span_id].attributes["xsp.grpc_code"] == "OK"
    text = scrape_registry(registry)
    assert sample_value(text, "xsp_otlp_export_total", outcome="exported") == len(replay) + 1
    assert sample_value(text, "xsp_otlp_export_total", outcome="failed") == 0
    assert sample_value(text, "xsp_otlp_export_total", outcome="dropped") == 0


def test_a_live_only_trace_exports_its_status_and_why_on_its_request_span(
    http_collector: tuple[OtlpReceiver, Received], tmp_path: Path
) -> None:
    """The trace row comes first (at the sampling decision) with no span to carry it; the
    relay's span, the trace's root, comes at the call's end and carries its header."""
    receiver, received = http_collector
    config = replace(
        sampling_config(tmp_path / "models", tmp_path / "traces.db"),
        otlp_export=f"http://127.0.0.1:{receiver.port}/v1/traces",
    )
    pipeline = SamplingPipeline(config, CollectorRegistry(), model_label)
    request, _, _, _ = worker_trace()
    why = Replayability(False, "model 'resnet50' is served by 'tensorrt_plan'")
    job = ProfileJob(request.trace_id, request.span_id, "resnet50", "ModelInfer", b"", "rate", 0)
    try:
        assert pipeline.export is not None
        assert pipeline.keep_live(job, why)  # the live-only trace row
        assert pipeline.store_spans(request.trace_id, [request])
        assert pipeline.writer is not None and pipeline.writer.flush(10)
        assert pipeline.export.flush(10)
        got = received.wait_for(1)
    finally:
        pipeline.stop()
    (span,) = got
    assert span.span_id == request.span_id and span.parent_span_id is None
    assert span.attributes["xsp.status"] == "live_only"
    assert span.attributes["xsp.replay"] == (
        "not_replayable: model 'resnet50' is served by 'tensorrt_plan'"
    )
    assert span.attributes["xsp.model"] == "resnet50"
    assert span.attributes["xsp.grpc_code"] == "OK"  # its own attributes, as before


def test_the_grpc_exporter_sends_the_same_tree(grpc_collector: tuple[int, Received]) -> None:
    port, received = grpc_collector
    trace, spans, stats = make_trace(layers=2, ids=Ids(random.Random(3)))
    export = OtlpTraceExport.to(f"grpc://127.0.0.1:{port}", schedule_delay_ms=50)
    try:
        assert export.offer(spans, trace, stats) == len(spans)
        assert export.flush(10)
        check_tree(received.wait_for(len(spans)), spans)
        assert export.exported == len(spans) and export.failed == export.dropped == 0
    finally:
        export.close()
    # the same port named http:// with protocol grpc
    assert parse_target(f"http://127.0.0.1:{port}", "grpc").endpoint == f"127.0.0.1:{port}"


def test_a_dead_endpoint_counts_failures_and_the_store_is_unaffected(tmp_path: Path) -> None:
    # the SDK retries a refused connection with backoff for up to its timeout: 1 s here
    target = parse_target(f"http://127.0.0.1:{free_port()}/v1/traces", "auto")
    export = OtlpTraceExport(make_exporter(target, timeout_s=1), max_batch=8)
    registry = CollectorRegistry()
    OtlpExportCollector(export, registry)
    traces = [make_trace(layers=2) for _ in range(5)]
    writer = TraceWriter(
        tmp_path / "t.db", on_stored=lambda item: export.offer(item.spans, item.trace)
    )
    try:
        started = time.perf_counter()
        for trace, spans, stats in traces:
            assert writer.submit(trace, spans, stats)
        submit_s = time.perf_counter() - started
        assert writer.flush(10)
        assert export.flush(10)
    finally:
        writer.close()
        export.close()
    total = sum(len(spans) for _, spans, _ in traces)
    assert submit_s < 0.5  # handing off never waits for the export
    assert writer.written == len(traces) and writer.failed == 0
    with TraceStore(tmp_path / "t.db") as store:
        assert sum(len(store.spans(t.trace_id)) for t, _, _ in traces) == total
    text = scrape_registry(registry)
    assert sample_value(text, "xsp_otlp_export_total", outcome="failed") == total
    assert sample_value(text, "xsp_otlp_export_total", outcome="exported") == 0
    # SDK 1.26 raised the connection error; newer SDKs log it and return FAILURE
    assert any(
        why in export.last_error
        for why in ("Connection refused", "Max retries", "SpanExportResult.FAILURE")
    )


class BlockingFakeExporter(SpanExporter):
    """A fake exporter that holds its first batch until released: the queue then fills."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(10)
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def test_a_full_queue_drops_spans_and_counts_them() -> None:
    fake = BlockingFakeExporter()
    export = OtlpTraceExport(fake, max_queue_size=16, max_batch=8, schedule_delay_ms=10)
    trace, spans, stats = make_trace(layers=10, kernels_per_layer=4)  # 52 spans
    try:
        started = time.perf_counter()
        export.offer(spans, trace, stats)
        assert time.perf_counter() - started < 0.5  # never waits for the blocked exporter
        fake.release.set()
        assert export.flush(10)
    finally:
        export.close()
    assert export.dropped > 0
    assert export.exported == fake.spans
    assert export.exported + export.dropped == len(spans)


@pytest.mark.parametrize(
    ("url", "protocol", "endpoint", "kind"),
    [
        ("http://c:4318/v1/traces", "auto", "http://c:4318/v1/traces", "http"),
        ("http://c:4318", "auto", "http://c:4318/v1/traces", "http"),
        ("grpc://c:4317", "auto", "c:4317", "grpc"),
        ("http://c:4317", "grpc", "c:4317", "grpc"),
    ],
)
def test_endpoints(url: str, protocol: str, endpoint: str, kind: str) -> None:
    target = parse_target(url, protocol)
    assert (target.endpoint, target.protocol) == (endpoint, kind)


@pytest.mark.parametrize(
    ("url", "protocol"), [("c:4317", "auto"), ("grpc://c:4317", "http"), ("ftp://c", "auto")]
)
def test_bad_endpoints(url: str, protocol: str) -> None:
    with pytest.raises(OtlpExportError):
        parse_target(url, protocol)
