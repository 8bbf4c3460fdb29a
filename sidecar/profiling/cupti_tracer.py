"""GPU kernel level over CUPTI's activity API (`cupti-python`), and XSP's correlation.

CUPTI delivers asynchronous activity records: kernels (CONCURRENT_KERNEL), memcpys, memsets,
and the CUDA runtime/driver API calls that launched them (RUNTIME, DRIVER). A GPU record is
joined to its launch API call by `correlation_id`; the launch, which runs on the CPU inside
a layer, is placed under its layer by time containment; the GPU record then gets that layer
as parent. Records become kernel spans (level K) with `kind` kernel / memcpy / memset /
runtime / driver and the attributes of docs/contracts.md.

Without an NVIDIA driver every CUPTI call raises; `CuptiTracer.start` turns that into a
`GpuNotAvailableError` saying so. Nothing here invents GPU numbers: spans carry only what
the records measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from sidecar.profiling.containment import GPU_ASYNC_KINDS, place_by_interval
from sidecar.profiling.runners.base import LevelNotSupportedError, RawSpan, keyed
from sidecar.trace.spans import Level, Span

# CUpti_ActivityKind values (cupti_activity.h).
KIND_MEMCPY, KIND_MEMSET, KIND_KERNEL, KIND_DRIVER, KIND_RUNTIME = 1, 2, 3, 4, 5
KIND_CONCURRENT_KERNEL = 10
KIND_NAMES = {
    KIND_MEMCPY: "memcpy",
    KIND_MEMSET: "memset",
    KIND_KERNEL: "kernel",
    KIND_DRIVER: "driver",
    KIND_RUNTIME: "runtime",
    KIND_CONCURRENT_KERNEL: "kernel",
}
# CUpti_ActivityMemcpyKind values.
COPY_KINDS = {
    0: "unknown",
    1: "HtoD",
    2: "DtoH",
    3: "HtoA",
    4: "AtoH",
    5: "AtoA",
    6: "AtoD",
    7: "DtoA",
    8: "DtoD",
    9: "HtoH",
    10: "PtoP",
}
API_KINDS = frozenset({"runtime", "driver"})


class GpuNotAvailableError(LevelNotSupportedError):
    """CUPTI cannot trace: no NVIDIA GPU or driver on this machine."""


def kind_name(kind: Any) -> str | None:
    """`kernel`, `memcpy`, ... for a CUPTI activity kind (int or enum); None if not traced."""
    try:
        return KIND_NAMES.get(int(kind))
    except (TypeError, ValueError):
        return None


def _api_name(record: Any, kind: str) -> str:
    name = getattr(record, "name", None)
    if name:
        return str(name)
    cbid = getattr(record, "cbid", None)
    try:  # cupti knows the names; it needs no driver for this lookup
        from cupti import cupti

        domain = (
            cupti.CallbackDomain.RUNTIME_API
            if kind == "runtime"
            else cupti.CallbackDomain.DRIVER_API
        )
        return str(cupti.get_callback_name(domain, int(cbid or 0)))
    except Exception:
        return f"{kind}:cbid={cbid}"


def record_to_span(record: Any, offset_ns: int) -> RawSpan | None:
    """One CUPTI activity record as a kernel-level span (epoch ns = CUPTI ns + offset)."""
    kind = kind_name(getattr(record, "kind", None))
    if kind is None:
        return None
    start = int(record.start) + offset_ns
    end = int(record.end) + offset_ns
    attrs: dict[str, Any] = {"correlation_id": int(getattr(record, "correlation_id", 0))}
    if kind in GPU_ASYNC_KINDS:
        attrs["device"] = int(getattr(record, "device_id", 0))
        attrs["stream"] = int(getattr(record, "stream_id", 0))
    if kind == "kernel":
        name = str(getattr(record, "name", "") or "kernel")
        attrs["grid"] = [int(getattr(record, f"grid_{a}", 0)) for a in "xyz"]
        attrs["block"] = [int(getattr(record, f"block_{a}", 0)) for a in "xyz"]
        for field in ("registers_per_thread", "static_shared_memory", "dynamic_shared_memory"):
            if hasattr(record, field):
                attrs[field] = int(getattr(record, field))
    elif kind == "memcpy":
        copy = COPY_KINDS.get(int(getattr(record, "copy_kind", 0)), "unknown")
        name = f"memcpy {copy}"
        attrs["bytes"] = int(getattr(record, "bytes", 0))
        attrs["copy_kind"] = copy
    elif kind == "memset":
        name = "memset"
        attrs["bytes"] = int(getattr(record, "bytes", 0))
    else:
        name = _api_name(record, kind)
        attrs["cbid"] = int(getattr(record, "cbid", 0))
    return RawSpan(Level.KERNEL, name, kind, start, end, attributes=attrs)


def records_to_spans(records: Iterable[Any], offset_ns: int) -> list[RawSpan]:
    """Convert a record stream; untraced kinds are skipped. Keys are made unique per name."""
    spans = [s for s in (record_to_span(r, offset_ns) for r in records) if s is not None]
    spans.sort(key=lambda s: (s.start_ns, s.end_ns))
    for span, key in zip(spans, keyed([f"{s.kind}:{s.name}" for s in spans]), strict=True):
        span.key = key
    return spans


def attach_gpu_activity(spans: Sequence[Span]) -> None:
    """Give each GPU kernel/memcpy/memset span the layer of its launch (XSP), in place.

    The launch is the runtime/driver span with the same `correlation_id`; it must already
    have its layer parent (interval containment). A GPU span whose launch is missing is
    flagged `parent_missing`; one whose launch has no unique layer inherits the flag.
    """
    launches: dict[int, Span] = {}
    for span in spans:
        if span.level is Level.KERNEL and span.kind in API_KINDS:
            cid = span.attributes.get("correlation_id")
            if cid:  # the driver call under a runtime call shares its id; keep the outer
                prev = launches.get(cid)
                if prev is None or span.timeline_ns > prev.timeline_ns:
                    launches[cid] = span
    layers = [s for s in spans if s.level is Level.LAYER]
    for span in spans:
        if span.level is not Level.KERNEL or span.kind not in GPU_ASYNC_KINDS:
            continue
        launch = launches.get(span.attributes.get("correlation_id", 0))
        if launch is None:
            span.parent_id = None
            span.attributes["parent_missing"] = True
            continue
        span.attributes["launch_span_id"] = launch.span_id
        span.attributes["launch_name"] = launch.name
        place_by_interval(span, launch.start_ns, launch.end_ns, layers)


class CuptiTracer:
    """Collect CUPTI activity records between `start()` and `stop()`."""

    def __init__(self, buffer_bytes: int = 8 * 1024 * 1024) -> None:
        self.buffer_bytes = buffer_bytes
        self.records: list[Any] = []
        self.offset_ns = 0
        self._kinds: list[Any] = []

    def start(self) -> None:
        try:
            from cupti import cupti
        except ImportError as exc:
            raise GpuNotAvailableError(
                f"kernel level needs cupti-python ({exc}); pip install cupti-python"
            ) from None
        kinds = [
            cupti.ActivityKind.CONCURRENT_KERNEL,
            cupti.ActivityKind.MEMCPY,
            cupti.ActivityKind.MEMSET,
            cupti.ActivityKind.RUNTIME,
            cupti.ActivityKind.DRIVER,
        ]
        try:
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            for kind in kinds:
                cupti.activity_enable(kind)
                self._kinds.append(kind)
            self.offset_ns = time.time_ns() - int(cupti.get_timestamp())
        except Exception as exc:  # NotSupportedError / cuptiError without a driver
            self._disable()
            raise GpuNotAvailableError(
                f"kernel level on a GPU runtime needs an NVIDIA GPU and driver; CUPTI says: {exc}"
            ) from None

    def stop(self) -> list[Any]:
        from cupti import cupti

        try:
            cupti.activity_flush_all(1)
        finally:
            self._disable()
        return self.records

    def _disable(self) -> None:
        try:
            from cupti import cupti

            for kind in self._kinds:
                cupti.activity_disable(kind)
        except Exception:
            pass
        self._kinds.clear()

    def _buffer_requested(self) -> tuple[int, int]:
        return self.buffer_bytes, 0

    def _buffer_completed(self, activities: list[Any]) -> None:
        self.records.extend(activities)


def split_records(
    records: Sequence[Any], walls: Sequence[tuple[int, int]], tracer: CuptiTracer
) -> list[list[RawSpan]]:
    """Convert records and split them into iterations: API calls by their start time inside
    an iteration's wall interval, GPU activity with the iteration of its launch."""
    spans = records_to_spans(records, tracer.offset_ns)
    per_iter: list[list[RawSpan]] = [[] for _ in walls]
    where: dict[int, int] = {}
    for span in spans:
        if span.kind in API_KINDS:
            for i, (w0, w1) in enumerate(walls):
                if w0 <= span.start_ns <= w1:
                    per_iter[i].append(span)
                    where.setdefault(span.attributes["correlation_id"], i)
                    break
    for span in spans:
        if span.kind not in API_KINDS:
            i = where.get(span.attributes["correlation_id"], -1)
            if i >= 0:
                per_iter[i].append(span)
    for group in per_iter:  # keys count repeats within one iteration
        group.sort(key=lambda s: (s.start_ns, s.end_ns))
        for span, key in zip(group, keyed([f"{s.kind}:{s.name}" for s in group]), strict=True):
            span.key = key
    return per_iter
