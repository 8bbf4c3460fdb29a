"""Triton's statistics extension: how many executions of each batch size a model has run.

`ModelStatistics` (KServe v2 gRPC) answers cumulative counters per model version: requests
(`inference_count`), executions of the model (`execution_count`, one per batch the scheduler
formed) and, per executed batch size, how many executions computed it (`batch_stats`).
Two reads around a sampled request give the batches the server ran in that window (see
`sampling.batch_windows`). The sidecar asks over its own connection to the backend, never on
the relay's path. tritonclient's generated messages decode the answer (loaded on first use:
the relay's process does not import them unless a window is read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

STATISTICS_PATH = "/inference.GRPCInferenceService/ModelStatistics"


@dataclass(frozen=True)
class ModelCounts:
    """One model's cumulative counters (all its versions added up)."""

    inferences: int = 0  # requests computed (a batch of 8 requests counts 8)
    executions: int = 0  # model executions (batches the scheduler formed)
    batches: Mapping[int, int] = field(default_factory=dict)  # batch size -> executions
    # when the model last finished a request (ms since the epoch, as Triton 2.51 stamps
    # `last_inference`: at completion; 0: none yet)
    last_inference_ms: int = 0


def read_statistics(channel: grpc.Channel, timeout_s: float) -> dict[str, ModelCounts]:
    """Every model's counters now, by model name; raises `grpc.RpcError` when the call fails."""
    from tritonclient.grpc import service_pb2

    call = channel.unary_unary(
        STATISTICS_PATH,
        request_serializer=service_pb2.ModelStatisticsRequest.SerializeToString,
        response_deserializer=service_pb2.ModelStatisticsResponse.FromString,
    )
    answer = call(service_pb2.ModelStatisticsRequest(), timeout=timeout_s)
    out: dict[str, ModelCounts] = {}
    for stats in answer.model_stats:
        seen = out.get(stats.name, ModelCounts())
        batches = dict(seen.batches)
        for batch in stats.batch_stats:
            size = int(batch.batch_size)
            batches[size] = batches.get(size, 0) + int(batch.compute_infer.count)
        out[stats.name] = ModelCounts(
            inferences=seen.inferences + int(stats.inference_count),
            executions=seen.executions + int(stats.execution_count),
            batches=batches,
            last_inference_ms=max(seen.last_inference_ms, int(stats.last_inference)),
        )
    return out
