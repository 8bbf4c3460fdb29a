"""Read what TensorFlow's profiler wrote (`*.xplane.pb`) and check it against our clock.

The host plane (`/host:CPU`) holds one line per thread; an op event's metadata is named
`node_name:op_type` with the op type as its display name, and its `shape` stat holds the
input shapes. Timestamps are line offsets in picoseconds from a start that the
`Task Environment` plane records as `profile_start_time` (Unix-epoch ns, CLOCK_REALTIME,
the clock `time.time_ns()` reads), so events are converted to epoch ns directly; without
that stat the profiler's own per-call events are matched to our walls instead
(`align_offset`). Either way, `assign` then checks that every op of a timed call lies inside
that call's host wall, and a trace that does not fit is rejected with the reason.
"""

from __future__ import annotations

import bisect
import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.profiling.runners.timing import align_offset
from sidecar.profiling.vocabulary import ProfilingError

DEFAULT_TOLERANCE_NS = 50_000


class TFClockError(ProfilingError):
    """TensorFlow's profiler events do not fit the host walls they were taken in."""


@dataclass(frozen=True)
class TFEvent:
    """One host-tracer event, on the epoch-ns clock once `XTrace.to_epoch` is applied."""

    name: str
    op_type: str  # empty for events that are not TensorFlow ops
    start_ns: int
    end_ns: int
    shapes: str = ""


@dataclass
class XTrace:
    """The op events and the per-call events of one profiler session."""

    ops: list[TFEvent]
    calls: list[TFEvent]
    start_time_ns: int | None  # profile_start_time; None when the file does not say


def read_xspace(logdir: str) -> XTrace:
    """Parse the newest `*.xplane.pb` under `logdir` (TensorFlow's profiler output)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # ships with TensorFlow

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise ProfilingError(f"TensorFlow's profiler wrote no *.xplane.pb under {logdir}")
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as fh:
        space.ParseFromString(fh.read())
    return parse_xspace(space)


def parse_xspace(space: object) -> XTrace:
    """Op events (`name:type`) and function-call events from an `XSpace` message."""
    start: int | None = None
    ops: list[TFEvent] = []
    calls: list[TFEvent] = []
    for plane in space.planes:  # type: ignore[attr-defined]
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        if plane.name == "Task Environment":
            for stat in plane.stats:
                if stat_names.get(stat.metadata_id) == "profile_start_time":
                    start = int(stat.uint64_value or stat.int64_value) or None
        if plane.name != "/host:CPU":
            continue
        shape_id = next((k for k, v in stat_names.items() if v == "shape"), None)
        for line in plane.lines:
            base_ps = int(line.timestamp_ns) * 1000
            for ev in line.events:
                md = plane.event_metadata[ev.metadata_id]
                t0 = (base_ps + int(ev.offset_ps)) // 1000
                t1 = (base_ps + int(ev.offset_ps) + int(ev.duration_ps)) // 1000
                if md.display_name and md.name.endswith(":" + md.display_name):
                    shapes = ""
                    for stat in ev.stats:
                        if stat.metadata_id == shape_id:  # interned: a reference to a name
                            shapes = stat.str_value or stat_names.get(stat.ref_value, "")
                    node = md.name[: -len(md.display_name) - 1]
                    ops.append(TFEvent(node, md.display_name, t0, t1, shapes))
                elif md.name.startswith("EagerLocalExecute: "):
                    calls.append(TFEvent(md.name.split(": ", 1)[1], "", t0, t1))
    ops.sort(key=lambda e: e.start_ns)
    calls.sort(key=lambda e: e.start_ns)
    return XTrace(ops, calls, start)


@dataclass
class Assigned:
    """Op events per timed call (epoch ns), and how the clock was matched."""

    ops: list[list[TFEvent]]
    clock: str  # "profile_start_time" or "aligned"


def assign(
    trace: XTrace,
    function: str,
    walls: Sequence[tuple[int, int]],
    tolerance_ns: int = DEFAULT_TOLERANCE_NS,
) -> Assigned:
    """Split the op events of the last `len(walls)` calls of `function` by call, on the
    epoch-ns clock; raise `TFClockError` when calls or ops fall outside their walls."""
    calls = [c for c in trace.calls if c.name == function][-len(walls) :]
    if len(calls) != len(walls):
        raise ProfilingError(
            f"TensorFlow's profiler recorded {len(calls)} calls of {function} for "
            f"{len(walls)} timed calls; the layer level cannot be split by call"
        )
    if trace.start_time_ns is not None:
        offset, clock = trace.start_time_ns, "profile_start_time"
    else:
        marks = [(c.start_ns, c.end_ns) for c in calls]
        offset, clock = align_offset(walls, marks), "aligned"
    starts = [c.start_ns for c in calls]
    per_call: list[list[TFEvent]] = [[] for _ in calls]
    stray = 0
    for op in trace.ops:
        if op.start_ns < starts[0]:
            continue  # warm-up calls inside the profiler
        k = bisect.bisect_right(starts, op.start_ns) - 1
        if op.end_ns > calls[k].end_ns:
            stray += 1
            continue
        per_call[k].append(
            TFEvent(op.name, op.op_type, op.start_ns + offset, op.end_ns + offset, op.shapes)
        )
    problems = []
    if stray:
        problems.append(f"{stray} op events lie outside every timed call of {function}")
    late = []
    for (w0, w1), call, ops in zip(walls, calls, per_call, strict=True):
        c0, c1 = call.start_ns + offset, call.end_ns + offset
        for t0, t1 in [(c0, c1), *((o.start_ns, o.end_ns) for o in ops)]:
            if t0 < w0 - tolerance_ns or t1 > w1 + tolerance_ns:
                late.append(max(w0 - t0, t1 - w1) / 1e6)
    if late:
        problems.append(
            f"{len(late)} profiler events lie outside the host wall of their call (by up to "
            f"{max(late):.3f} ms, clock: {clock})"
        )
    if problems:
        raise TFClockError(
            "layer level rejected: TensorFlow's profiler events do not fit the timed calls ("
            + "; ".join(problems)
            + "); nothing from this run is stored"
        )
    return Assigned(per_call, clock)
