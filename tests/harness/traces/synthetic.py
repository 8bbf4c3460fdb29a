"""Synthetic traces: the records of `sidecar.trace.spans` built in code, no profiler run.

`make_trace()` builds one trace of any size (request, model, layers, kernels) with fresh ids,
for the trace store's tests (writer, retention, crashes, memory); `Ids` draws W3C-shaped ids,
deterministic from a seeded generator. The report's scenarios are in `report_scenarios`.
"""

from __future__ import annotations

import random
import time

from sidecar.trace.spans import Level, LevelStats, Source, Span, Trace, new_span_id, new_trace_id

TraceParts = tuple[Trace, list[Span], list[LevelStats]]

BASE_NS = 1_790_000_000_000_000_000  # 2026-09-21, one clock for all test traces
HOUR_NS = 3_600_000_000_000


class Ids:
    """W3C-shaped ids: deterministic when drawn from `rng`, fresh random ones without it."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng

    def trace(self) -> str:
        return new_trace_id() if self.rng is None else f"{self.rng.getrandbits(128):032x}"

    def span(self) -> str:
        return new_span_id() if self.rng is None else f"{self.rng.getrandbits(64):016x}"


def make_trace(
    *,
    model: str = "resnet50",
    layers: int = 3,
    kernels_per_layer: int = 2,
    created_ns: int | None = None,
    batch_size: int | None = 1,
    pad: int = 0,
    trace_id: str | None = None,
    ids: Ids | None = None,
) -> TraceParts:
    """A trace with one request span, one model span, `layers` layers with kernels under each.

    `trace.attributes["span_count"]` and `["stats_count"]` say how many rows belong to it, so
    crash tests can check completeness. `pad` adds that many bytes of attribute text per span.
    Ids are fresh random ones unless `ids` draws them from a seeded generator.
    """
    ids = ids or Ids()
    tid = trace_id or ids.trace()
    t0 = time.time_ns() if created_ns is None else created_ns
    spans: list[Span] = []
    request = Span(
        tid,
        ids.span(),
        None,
        Level.REQUEST,
        "ModelInfer",
        "ModelInfer",
        t0,
        t0 + 9_000_000,
        Source.PROXY,
        attributes={"grpc_code": "OK", "request_bytes": 1234, "path": "/x/y"},
    )
    model_span = Span(
        tid,
        ids.span(),
        request.span_id,
        Level.MODEL,
        model,
        "model",
        t0 + 1_000,
        t0 + 8_000_000,
        Source.REPLAY,
        duration_ns=7_500_000,
        run_level=Level.MODEL,
    )
    spans += [request, model_span]
    step = 7_000_000 // max(layers, 1)
    for i in range(layers):
        start = t0 + 2_000 + i * step
        layer = Span(
            tid,
            ids.span(),
            model_span.span_id,
            Level.LAYER,
            f"conv_{i}",
            "Conv",
            start,
            start + step - 10,
            Source.REPLAY,
            run_level=Level.LAYER,
            index=i,
            attributes={
                "op_type": "Conv",
                "input_shapes": [[1, 3, 224, 224], [64, 3, 7, 7]],
                "output_shapes": [[1, 64, 112, 112]],
                "flops": 118_013_952.0,
                "flops_estimated": True,
                "parent_ambiguous": False,
                "pad": "x" * pad,
            },
        )
        spans.append(layer)
        kstep = (step - 20) // max(kernels_per_layer, 1)
        for k in range(kernels_per_layer):
            ks = start + 5 + k * kstep
            spans.append(
                Span(
                    tid,
                    ids.span(),
                    layer.span_id,
                    Level.KERNEL,
                    f"aten::conv_{k}",
                    "cpu_op",
                    ks,
                    ks + kstep - 5,
                    Source.REPLAY,
                    run_level=Level.KERNEL,
                    index=k,
                    attributes={"correlation_id": k, "pad": "y" * pad},
                )
            )
    stats = [
        LevelStats(
            tid,
            level,
            10,
            3,
            7_500_000 + d,
            7_400_000 + d,
            7_000_000,
            9_000_000,
            1.0 + d / 7_500_000,
            [7_000_000 + d, 7_500_000, 9_000_000],
        )
        for level, d in ((Level.MODEL, 0), (Level.LAYER, 900_000), (Level.KERNEL, 2_000_000))
    ]
    trace = Trace(
        trace_id=tid,
        model=model,
        created_ns=t0,
        model_version="3",
        batch_size=batch_size,
        runtime="onnxruntime 1.20.1 (CPUExecutionProvider)",
        device="Intel Xeon (2 cores)",
        sample_reason="forced",
        sidecar_version="0.1.0",
        attributes={
            "span_count": len(spans),
            "stats_count": len(stats),
            "inputs": [{"name": "x", "shape": [1, 3, 224, 224], "dtype": "FP32", "digest": "ab"}],
            "levels": ["model", "layer", "kernel"],
        },
    )
    return trace, spans, stats
