"""Triton flags that send its OpenTelemetry spans to the sidecar's OTLP receiver.

`rate=0` makes Triton trace only the requests that carry a `traceparent`, i.e. exactly the
ones the sidecar sampled (docs/triton-tracing.md).
"""

from __future__ import annotations

from pathlib import Path

from tests.harness.triton.server import TritonServer


def opentelemetry_args(otlp_url: str, schedule_delay_ms: int = 500) -> list[str]:
    """`--trace-config` arguments for `tritonserver` exporting to `otlp_url`."""
    return [
        "--trace-config", "mode=opentelemetry",
        "--trace-config", f"opentelemetry,url={otlp_url}",
        "--trace-config", "rate=0",
        "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "count=-1",
        "--trace-config", f"opentelemetry,bsp_schedule_delay={schedule_delay_ms}",
    ]  # fmt: skip


def traced_server(
    model_repository: Path, log_path: Path, otlp_url: str, schedule_delay_ms: int = 500
) -> TritonServer:
    """A `TritonServer` (not started yet) whose OpenTelemetry spans go to `otlp_url`."""
    return TritonServer(
        model_repository=model_repository,
        log_path=log_path,
        extra_args=opentelemetry_args(otlp_url, schedule_delay_ms),
    )
