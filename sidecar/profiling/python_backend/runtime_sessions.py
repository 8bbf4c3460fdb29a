"""Level K of a Python-backend model: the ONNX Runtime nodes below its Python calls.

While a model's code runs (import, `initialize`, `execute`: `loader.stand_in`),
`onnxruntime.InferenceSession` is `TrackedSession`, a subclass that records how each session
was made into the `Sessions` of the model whose code made it (a BLS callee's ONNX session goes
to the model that called it). Nothing else changes: the M and L runs use those sessions as
the model made them, unprofiled.

In the K run, `Sessions.profiling()` gives each recorded session a twin made the same way
with ONNX Runtime's profiler on (`enable_profiling` in its `SessionOptions`) and swaps the
twin's state in, so the model's own `session.run(...)` runs the twin; afterwards the session
gets its own state back and each twin's profile (`end_profiling`) is read: every node event
becomes a kernel span (`cpu_op`, `op_type`, shapes, provider, sizes as the ONNX runner
records them) on the epoch clock, through the twin's profiling start time. Interval
containment then makes each node a child of the Python call that ran it (the model's
`InferenceSession.run` call, or the `bls:<model>` span of a BLS call).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.profiling.vocabulary import RawSpan
from sidecar.trace import schema
from sidecar.trace.spans import Level

NODE_SUFFIX = "_kernel_time"
# the `Sessions` that sessions made here go to (a context variable: BLS `async_exec` calls run
# in other threads with the caller's context)
_current: contextvars.ContextVar[Sessions | None] = contextvars.ContextVar(
    "xsp_ort_sessions", default=None
)
_patch_lock = threading.Lock()
_patched = [0]  # how many `recording` blocks are open (the class is patched while any is)


@dataclass
class _Made:
    """How one session was made: what `InferenceSession(...)` was called with."""

    session: weakref.ref[Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Sessions:
    """The ONNX Runtime sessions one model's code made."""

    made: list[_Made] = field(default_factory=list)

    def live(self) -> list[_Made]:
        self.made = [m for m in self.made if m.session() is not None]
        return self.made

    @contextlib.contextmanager
    def profiling(self) -> Iterator[Profiles]:
        """While open, every live session runs a profiling twin; the `Profiles` it yields
        holds their node events once it closes."""
        profiles = Profiles()
        swapped: list[tuple[Any, dict[str, Any], Any]] = []
        with tempfile.TemporaryDirectory(prefix="xsp-pyort-") as tmp:
            try:
                for i, made in enumerate(self.live()):
                    session = made.session()
                    if session is None:
                        continue
                    try:
                        twin = _profiling_twin(made, os.path.join(tmp, f"s{i}"))
                    except Exception as exc:  # ORT's own types: that session runs unprofiled
                        profiles.failed.append(f"{type(exc).__name__}: {exc}"[:300])
                        continue
                    swapped.append((session, session.__dict__, twin))
                    session.__dict__ = twin.__dict__
                yield profiles
            finally:
                for session, own, twin in swapped:
                    session.__dict__ = own
                    profiles.add(twin)


@dataclass
class Profiles:
    """The node events of the profiling twins of one K run, on the epoch-ns clock."""

    nodes: list[RawSpan] = field(default_factory=list)
    sessions: int = 0  # how many sessions ran with the profiler on
    failed: list[str] = field(default_factory=list)  # why a session's twin could not be made

    def add(self, twin: Any) -> None:
        self.sessions += 1
        start_ns = int(twin.get_profiling_start_time_ns())
        events = json.loads(Path(twin.end_profiling()).read_text())
        for event in events:
            if event.get("cat") == "Node" and str(event.get("name", "")).endswith(NODE_SUFFIX):
                self.nodes.append(node_span(event, start_ns))

    def within(self, start_ns: int, end_ns: int) -> list[RawSpan]:
        """The node spans inside [start_ns, end_ns] (one iteration), in start order."""
        found = [s for s in self.nodes if start_ns <= s.start_ns and s.end_ns <= end_ns]
        return sorted(found, key=lambda s: s.start_ns)


def node_span(event: dict[str, Any], start_ns: int) -> RawSpan:
    """An ONNX Runtime node event as a kernel span (`ts`/`dur`: µs after `start_ns`)."""
    args = event.get("args", {})
    op_type = str(args.get("op_name", "unknown"))
    attrs: dict[str, Any] = {
        schema.OP_TYPE: op_type,
        schema.RUNTIME: "onnxruntime",
        schema.INPUT_SHAPES: [
            list(map(int, s)) for e in args.get("input_type_shape", []) for s in e.values()
        ],
        schema.OUTPUT_SHAPES: [
            list(map(int, s)) for e in args.get("output_type_shape", []) for s in e.values()
        ],
        schema.PROVIDER: args.get("provider", ""),
        schema.DEVICE: "cpu",
        schema.ACTIVATION_BYTES: int(args.get("activation_size", 0)),
        schema.PARAMETER_BYTES: int(args.get("parameter_size", 0)),
        schema.OUTPUT_BYTES: int(args.get("output_size", 0)),
    }
    start = start_ns + int(event["ts"]) * 1000
    end = start + int(event["dur"]) * 1000
    name = str(event["name"])[: -len(NODE_SUFFIX)]
    return RawSpan(Level.KERNEL, name, schema.KernelKind.CPU_OP, start, end, attributes=attrs)


def _profiling_twin(made: _Made, prefix: str) -> Any:
    """A session made as `made` was, with ONNX Runtime's profiler writing to `prefix`."""
    import onnxruntime as ort

    args, kwargs = list(made.args), dict(made.kwargs)
    options = kwargs.get("sess_options", args[1] if len(args) > 1 else None)
    if options is None:
        options = ort.SessionOptions()
    before = (options.enable_profiling, options.profile_file_prefix)
    options.enable_profiling, options.profile_file_prefix = True, prefix
    try:
        if "sess_options" in kwargs or len(args) <= 1:
            kwargs["sess_options"] = options
        else:
            args[1] = options
        return _ORIGINAL[0](*args, **kwargs)
    finally:  # the options are read when a session is made: the model's own stay as given
        options.enable_profiling, options.profile_file_prefix = before


_ORIGINAL: list[Any] = []  # onnxruntime's own InferenceSession and the tracked subclass


def _tracked_class(original: Any) -> Any:
    class TrackedSession(original):
        """`onnxruntime.InferenceSession`, recording how it was made (see module)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            sessions = _current.get()
            if sessions is not None:
                sessions.made.append(_Made(weakref.ref(self), args, kwargs))

    TrackedSession.__name__ = TrackedSession.__qualname__ = original.__name__
    TrackedSession.__module__ = original.__module__
    return TrackedSession


@contextlib.contextmanager
def recording(sessions: Sessions) -> Iterator[None]:
    """Sessions made while open go to `sessions` (nested: the innermost); while any block is
    open, `onnxruntime.InferenceSession` is the tracked subclass."""
    try:
        import onnxruntime as ort
    except ImportError:  # no ONNX Runtime: no session to record
        yield
        return
    with _patch_lock:
        if not _ORIGINAL:
            _ORIGINAL.extend([ort.InferenceSession, _tracked_class(ort.InferenceSession)])
        if _patched[0] == 0:
            ort.InferenceSession = _ORIGINAL[1]
        _patched[0] += 1
    token = _current.set(sessions)
    try:
        yield
    finally:
        _current.reset(token)
        with _patch_lock:
            _patched[0] -= 1
            if _patched[0] == 0:
                ort.InferenceSession = _ORIGINAL[0]
