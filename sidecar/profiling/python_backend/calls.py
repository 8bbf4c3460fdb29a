"""Level L of a Python-backend model: the Python calls inside `execute`, by `sys.setprofile`.

Recorded: every call of a function defined in the model's own files (its `model.py`, and those
of Python models it calls over BLS) and every call such a function makes directly into other
code (a library's Python function or a C function: `InferenceSession.run`, `np.concatenate`),
each as a layer span (`python_function` or `call`). Calls into the stand-in `pb_utils`, the
methods of plain containers (`responses.append`) and `execute` itself (the model span) are
left out; deeper library internals are not spans.

Python 3.11 has no `sys.monitoring`; `sys.setprofile` calls a Python function on every call
and return in the thread, recorded or not, so L's overhead grows with the number of Python
calls `execute` makes: the experiment reports it as L's overhead ratio.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from types import CodeType, FrameType
from typing import Any

from sidecar.profiling.python_backend import pb_utils
from sidecar.profiling.vocabulary import RawSpan
from sidecar.trace import schema
from sidecar.trace.spans import Level

MAX_SPANS = 2000  # per execute; more are counted, not kept
_PLAIN = frozenset({list, dict, set, tuple, str, bytes})  # `responses.append(...)`: not a span
_STAND_IN = pb_utils.__file__


class CallTracer:
    """Record the model's Python calls while active (`with tracer:`), on the epoch-ns clock."""

    def __init__(self, files: Iterable[str], skip: Iterable[CodeType], offset_ns: int) -> None:
        self.files = set(files)
        self.skip = set(skip)
        self.offset_ns = offset_ns
        self.spans: list[RawSpan] = []
        self.dropped = 0
        self._open: dict[Any, RawSpan] = {}
        self._depth = 0

    def __enter__(self) -> CallTracer:
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _start(self, key: Any, name: str, kind: str, **attributes: Any) -> None:
        if len(self.spans) >= MAX_SPANS:
            self.dropped += 1
            return
        now = time.perf_counter_ns() + self.offset_ns
        span = RawSpan(Level.LAYER, name, kind, now, now, attributes=attributes)
        span.attributes[schema.CALL_DEPTH] = self._depth
        self._depth += 1
        self.spans.append(span)
        self._open[key] = span

    def _end(self, key: Any) -> None:
        span = self._open.pop(key, None)
        if span is not None:
            span.end_ns = time.perf_counter_ns() + self.offset_ns
            self._depth -= 1

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call":
            if code in self.skip:
                return
            if code.co_filename in self.files:
                self._start(
                    id(frame), code.co_qualname, "python_function", line=code.co_firstlineno
                )
                return
            caller = frame.f_back
            if (
                caller is not None
                and caller.f_code.co_filename in self.files
                and code.co_filename != _STAND_IN
            ):
                module = frame.f_globals.get("__name__", "")
                self._start(id(frame), f"{module}.{code.co_qualname}".lstrip("."), "call")
        elif event == "return":
            self._end(id(frame))
        elif event == "c_call":
            if (
                code.co_filename in self.files
                and type(getattr(arg, "__self__", None)) not in _PLAIN
            ):
                module = getattr(arg, "__module__", None) or ""
                name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
                self._start((id(frame), id(arg)), f"{module}.{name}".lstrip("."), "call")
        elif event in ("c_return", "c_exception"):
            self._end((id(frame), id(arg)))

    def finished(self) -> list[RawSpan]:
        """The spans recorded, in start order (any left open end where the last one ended)."""
        end = max((s.end_ns for s in self.spans), default=0)
        for span in self._open.values():
            span.end_ns = max(span.end_ns, end)
        self._open.clear()
        return list(self.spans)
