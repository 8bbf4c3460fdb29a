"""GPU kernel level over CUPTI's activity API (`cupti-python`), and XSP's correlation.

CUPTI delivers asynchronous activity records: kernels (CONCURRENT_KERNEL), memcpys, memsets,
and the CUDA runtime/driver API calls that launched them (RUNTIME, DRIVER). A GPU record is
joined to its launch API call by `correlation_id`; the launch, which runs on the CPU inside
a layer, is placed under its layer by time containment; the GPU record then gets that layer
as parent (`gpu.attribution`, where the rule is written). Records become kernel spans
(level K) with `kind` kernel / memcpy / memset / runtime / driver and the attributes of
docs/contracts.md.

The tracer records only what attribution needs: kernels, memcpys, memsets and the API calls
that launch them: the runtime and driver kinds are enabled, then CUPTI's per-callback-id
switches turn off every call that launches nothing (switches on a kind that is off record
nothing once a CUDA context exists, which is why the kinds go on first); where the switches
are missing, all calls are recorded and those that launched nothing are dropped at `stop()`.
A ResNet-50 forward makes ~4,100 API records of which ~250 launch work. Every GPU record
must come with its launch: `gpu.clock_check` rejects a K run where one does not. Records may be
cupti-python objects or plain dicts (recordings, see `gpu.recording`).

Without an NVIDIA driver every CUPTI call raises; `CuptiTracer.start` turns that into a
`GpuNotAvailableError` saying so. Nothing here invents GPU numbers: spans carry only what
the records measured.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sidecar.profiling.containment import API_KINDS, GPU_ASYNC_KINDS
from sidecar.profiling.gpu.demangle import demangle, short_name
from sidecar.profiling.gpu.owner import CUPTI_TRACER, PROCESS_OWNER, CuptiOwner
from sidecar.profiling.vocabulary import LevelNotSupportedError, RawSpan, keyed
from sidecar.trace import schema
from sidecar.trace.spans import Level

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
# Runtime/driver calls that put work on the GPU (kernels, graphs, copies, sets), by name.
LAUNCH_API = re.compile(
    r"^(cuda|cu|cu64)(LaunchKernel|LaunchCooperativeKernel|LaunchGrid|Launch_|Launch$"
    r"|Memcpy|Memset|GraphLaunch)"
)


def field(record: Any, name: str, default: Any = None) -> Any:
    """One field of an activity record: a cupti-python object or a dict (recordings)."""
    if isinstance(record, Mapping):
        return record.get(name, default)
    return getattr(record, name, default)


class GpuNotAvailableError(LevelNotSupportedError):
    """CUPTI cannot trace: no NVIDIA GPU or driver on this machine."""


def kind_name(kind: Any) -> str | None:
    """`kernel`, `memcpy`, ... for a CUPTI activity kind (int or enum); None if not traced."""
    try:
        return KIND_NAMES.get(int(kind))
    except (TypeError, ValueError):
        return None


# cupti-python's callback-id enums: CamelCase from 13.1 on, snake_case in 13.0.x
CBID_TABLE_NAMES = {
    "runtime": ("RuntimeApiTraceCbid", "runtime_api_trace_cbid"),
    "driver": ("DriverApiTraceCbid", "driver_api_trace_cbid"),
}


def cbid_table(cupti: Any, kind: str) -> Any:
    """The callback-id enum of `kind` (`runtime` or `driver`) in this cupti-python, under
    whichever name its version gives it; AttributeError where it has none."""
    for name in CBID_TABLE_NAMES[kind]:
        table = getattr(cupti, name, None)
        if table is not None:
            return table
    raise AttributeError(f"cupti-python has no {kind} callback-id table")


@functools.lru_cache(maxsize=2048)
def api_name(kind: str, cbid: int) -> str:
    """`cudaLaunchKernel` for (`runtime`, 211): cupti-python's callback-id tables need no
    driver (the version suffix `_v7000` is dropped)."""
    try:
        from cupti import cupti

        return re.sub(r"_v\d+$", "", str(cbid_table(cupti, kind)(cbid).name))
    except Exception:  # no cupti-python, or an id this version does not know
        return f"{kind}:cbid={cbid}"


def _api_name(record: Any, kind: str) -> str:
    name = field(record, "name")
    if name:
        return str(name)
    return api_name(kind, int(field(record, "cbid", 0) or 0))


def record_to_span(record: Any, offset_ns: int) -> RawSpan | None:
    """One CUPTI activity record as a kernel-level span (epoch ns = CUPTI ns + offset).

    Kernel spans are named with the full demangled name; `short_name` (for text and HTML)
    and `mangled_name` go beside it. Graph-launched kernels keep `graph_id`/`graph_node_id`.
    """
    kind = kind_name(field(record, "kind"))
    if kind is None:
        return None
    start = int(field(record, "start")) + offset_ns
    end = int(field(record, "end")) + offset_ns
    attrs: dict[str, Any] = {schema.CORRELATION_ID: int(field(record, "correlation_id", 0) or 0)}
    if kind in GPU_ASYNC_KINDS:
        attrs[schema.DEVICE] = int(field(record, "device_id", 0) or 0)
        attrs[schema.STREAM] = int(field(record, "stream_id", 0) or 0)
        for key in ("graph_id", "graph_node_id"):
            if field(record, key):
                attrs[key] = int(field(record, key))
    if kind == "kernel":
        mangled = str(field(record, "name", "") or "kernel")
        name = demangle(mangled)
        attrs[schema.SHORT_NAME] = short_name(mangled)
        if name != mangled:
            attrs[schema.MANGLED_NAME] = mangled
        attrs[schema.GRID] = [int(field(record, f"grid_{a}", 0) or 0) for a in "xyz"]
        attrs[schema.BLOCK] = [int(field(record, f"block_{a}", 0) or 0) for a in "xyz"]
        for key in (
            schema.REGISTERS_PER_THREAD,
            schema.STATIC_SHARED_MEMORY,
            schema.DYNAMIC_SHARED_MEMORY,
        ):
            if field(record, key) is not None:
                attrs[key] = int(field(record, key))
    elif kind == "memcpy":
        copy = COPY_KINDS.get(int(field(record, "copy_kind", 0) or 0), "unknown")
        name = f"memcpy {copy}"
        attrs[schema.BYTES] = int(field(record, "bytes", 0) or 0)
        attrs[schema.COPY_KIND] = copy
    elif kind == "memset":
        name = "memset"
        attrs[schema.BYTES] = int(field(record, "bytes", 0) or 0)
    else:
        name = _api_name(record, kind)
        attrs[schema.CBID] = int(field(record, "cbid", 0) or 0)
    return RawSpan(Level.KERNEL, name, kind, start, end, attributes=attrs)


def launch_records_only(records: Iterable[Any]) -> list[Any]:
    """Drop API records that launched nothing (no GPU record shares their correlation id)."""
    records = list(records)
    gpu_ids = {
        field(r, "correlation_id")
        for r in records
        if kind_name(field(r, "kind")) in GPU_ASYNC_KINDS
    }
    return [
        r
        for r in records
        if kind_name(field(r, "kind")) not in API_KINDS or field(r, "correlation_id") in gpu_ids
    ]


def records_to_spans(records: Iterable[Any], offset_ns: int) -> list[RawSpan]:
    """Convert a record stream; untraced kinds are skipped. Keys are made unique per name."""
    spans = [s for s in (record_to_span(r, offset_ns) for r in records) if s is not None]
    spans.sort(key=lambda s: (s.start_ns, s.end_ns))
    for span, key in zip(spans, keyed([f"{s.kind}:{s.name}" for s in spans]), strict=True):
        span.key = key
    return spans


def non_launch_cbids(table: Any) -> list[int]:
    """The callback ids in a cupti-python callback-id table (`cbid_table`) of the calls
    that launch no GPU work (placeholders and reserved ids left out)."""
    return [
        int(m)
        for m in table
        if m.name.startswith("cu") and not LAUNCH_API.match(m.name) and 0 < int(m) < 2**31 - 1
    ]


class CuptiTracer:
    """Collect CUPTI activity records between `start()` and `stop()`: GPU work and the API
    calls that launched it (`all_api=True` keeps every runtime/driver call)."""

    def __init__(
        self,
        buffer_bytes: int = 8 * 1024 * 1024,
        *,
        all_api: bool = False,
        owner: CuptiOwner = PROCESS_OWNER,
    ) -> None:
        self.buffer_bytes = buffer_bytes
        self.all_api = all_api
        self.owner = owner
        self.records: list[Any] = []
        self.offset_ns = 0
        self.api_filter = "none"  # how API records were limited: cbid | after-stop | none
        self._kinds: list[Any] = []

    def start(self) -> None:
        try:
            from cupti import cupti
        except ImportError as exc:
            raise GpuNotAvailableError(
                f"kernel level needs cupti-python ({exc}); pip install cupti-python"
            ) from None
        if not hasattr(cupti.ActivityKind, "RUNTIME"):  # before cupti-python 13
            raise GpuNotAvailableError(
                "kernel level needs cupti-python 13 or newer: this one cannot record the "
                "runtime API calls that launch most kernels (ActivityKind.RUNTIME)"
            )
        self.owner.check(CUPTI_TRACER)
        kinds = [
            cupti.ActivityKind.CONCURRENT_KERNEL,
            cupti.ActivityKind.MEMCPY,
            cupti.ActivityKind.MEMSET,
        ]
        try:
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            for kind in kinds:
                cupti.activity_enable(kind)
                self._kinds.append(kind)
            self._enable_api(cupti)
            self.offset_ns = time.time_ns() - int(cupti.get_timestamp())
        except Exception as exc:  # NotSupportedError / cuptiError without a driver
            self._disable()
            raise GpuNotAvailableError(
                f"kernel level on a GPU runtime needs an NVIDIA GPU and driver; CUPTI says: {exc}"
            ) from None
        self.owner.claim(CUPTI_TRACER)  # only once CUPTI really records for this process

    def _enable_api(self, cupti: Any) -> None:
        """Record the runtime and driver calls; unless `all_api`, switch off every call that
        launches nothing.

        The order is CUPTI's: per-function switches on a kind that is off record nothing once
        the process has a CUDA context (as it has here: the model is on the GPU), and
        enabling a kind forgets earlier switches. So the kinds go on first and the calls that
        launch nothing are switched off after. Where the switches are missing or refused,
        every call is recorded and those that launched nothing are dropped at `stop()`.
        """
        for kind in (cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER):
            cupti.activity_enable(kind)
            self._kinds.append(kind)
        if self.all_api:
            self.api_filter = "none"
            return
        self.api_filter = "after-stop"
        try:
            switches = (
                (cupti.activity_enable_runtime_api, cbid_table(cupti, "runtime")),
                (cupti.activity_enable_driver_api, cbid_table(cupti, "driver")),
            )
        except AttributeError:  # cupti-python without per-function switches
            return
        switched_off = 0
        for enable, table in switches:
            for cbid in non_launch_cbids(table):
                try:
                    enable(cbid, 0)
                except Exception:  # an id this CUPTI does not know: nothing to switch off
                    continue
                switched_off += 1
        if switched_off:
            self.api_filter = "cbid"

    def stop(self) -> list[Any]:
        from cupti import cupti

        try:
            cupti.activity_flush_all(1)
        finally:
            self._disable()
        if not self.all_api:
            self.records = launch_records_only(self.records)
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
    records: Sequence[Any], walls: Sequence[tuple[int, int]], tracer: CuptiTracer | int
) -> list[list[RawSpan]]:
    """Convert records and split them into iterations (see `split_spans`). `tracer` is the
    tracer that took the records, or its CUPTI -> epoch offset."""
    offset = tracer if isinstance(tracer, int) else tracer.offset_ns
    return split_spans(records_to_spans(records, offset), walls)


def split_spans(spans: Sequence[RawSpan], walls: Sequence[tuple[int, int]]) -> list[list[RawSpan]]:
    """Kernel-level spans per iteration: API calls by their start time inside an
    iteration's wall interval, GPU activity with the iteration of its launch."""
    per_iter: list[list[RawSpan]] = [[] for _ in walls]
    where: dict[int, int] = {}
    for span in spans:
        if span.kind in API_KINDS:
            for i, (w0, w1) in enumerate(walls):
                if w0 <= span.start_ns <= w1:
                    per_iter[i].append(span)
                    where.setdefault(span.attributes[schema.CORRELATION_ID], i)
                    break
    for span in spans:
        if span.kind not in API_KINDS:
            i = where.get(span.attributes[schema.CORRELATION_ID], -1)
            if i >= 0:
                per_iter[i].append(span)
    for group in per_iter:  # keys count repeats within one iteration
        group.sort(key=lambda s: (s.start_ns, s.end_ns))
        for span, key in zip(group, keyed([f"{s.kind}:{s.name}" for s in group]), strict=True):
            span.key = key
    return per_iter
