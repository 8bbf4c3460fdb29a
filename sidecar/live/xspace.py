"""TensorFlow's XSpace (what its profiler collects) -> the TensorFlow op events of the host.

A TensorFlow 2.19 capture holds a `/host:CPU` plane whose lines are threads; an op kernel's
event is named `<node name>:<op type>` (e.g. `StatefulPartitionedCall/keras_cnn_1/conv1_1/
Relu:_MklNativeFusedConv2D`), next to runtime events such as `ExecutorState::Process` or
`EagerLocalExecute: __inference_...`, which are not ops. The `Task Environment` plane holds the
session's `profile_start_time` / `profile_stop_time` (Unix epoch ns); line timestamps are
relative to the start (TensorFlow normalizes them when it collects the data), event offsets
are picoseconds from their line's timestamp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sidecar.live._proto.tensorflow.tsl.profiler.protobuf import xplane_pb2

HOST_PLANE = "/host:CPU"
ENVIRONMENT_PLANE = "Task Environment"
_OP_TYPE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class XSpaceError(ValueError):
    """The bytes are not a readable XSpace."""


@dataclass(frozen=True)
class OpEvent:
    """One TensorFlow op kernel's run on a host thread (wall clock, Unix epoch ns)."""

    name: str  # the node name, its name scopes included
    op_type: str
    start_ns: int
    end_ns: int
    thread: str

    @property
    def name_scope(self) -> str:
        """The scopes of the node (`StatefulPartitionedCall/keras_cnn_1/conv1_1`)."""
        return self.name.rpartition("/")[0]


@dataclass
class HostCapture:
    """The op events of one capture and the session's own start and stop (None if absent)."""

    start_ns: int | None = None
    stop_ns: int | None = None
    ops: list[OpEvent] = field(default_factory=list)
    hostnames: list[str] = field(default_factory=list)


def split_op_name(event_name: str) -> tuple[str, str] | None:
    """`(node name, op type)` of an op event's name, None for any other event."""
    name, colon, op_type = event_name.rpartition(":")
    if not colon or not name or name.endswith(":") or " " in name:
        return None
    if _OP_TYPE.fullmatch(op_type) is None:
        return None
    return name, op_type


def _environment(space: xplane_pb2.XSpace) -> tuple[int | None, int | None]:
    for plane in space.planes:
        if plane.name != ENVIRONMENT_PLANE:
            continue
        values = {plane.stat_metadata[s.metadata_id].name: s.uint64_value for s in plane.stats}
        return values.get("profile_start_time") or None, values.get("profile_stop_time") or None
    return None, None


def parse_xspace(data: bytes) -> HostCapture:
    """The host's op events in `data` (a serialized XSpace), in start order."""
    try:
        space = xplane_pb2.XSpace.FromString(data)
    except Exception as exc:  # protobuf's DecodeError, or anything a damaged file gives
        raise XSpaceError(f"not an XSpace ({type(exc).__name__})") from None
    start, stop = _environment(space)
    capture = HostCapture(start_ns=start, stop_ns=stop, hostnames=list(space.hostnames))
    for plane in space.planes:
        if plane.name != HOST_PLANE:
            continue
        names = {key: split_op_name(meta.name) for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns
            if start is not None and base < start:  # relative to the session's start
                base += start
            thread = line.display_name or line.name
            for event in line.events:
                parsed = names.get(event.metadata_id)
                if parsed is None or event.WhichOneof("data") != "offset_ps":
                    continue
                begin = base + event.offset_ps // 1000
                end = begin + event.duration_ps // 1000
                capture.ops.append(OpEvent(parsed[0], parsed[1], begin, end, thread))
    capture.ops.sort(key=lambda op: (op.start_ns, -op.end_ns))
    return capture
