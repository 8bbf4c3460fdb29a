"""BLS inside a replayed Python model: `InferenceRequest(...).exec()` goes to a replay.

The called model is looked up in the same repository, by the lookup the replay hands over:
an ONNX model runs in ONNX Runtime (one CPU session per model, one thread), another Python
model is loaded and run the same way, recursively. Each call is recorded (`BlsCall`) and
becomes a layer span of kind `bls` of the calling model. A model that cannot be replayed
answers with an error response that says why, as Triton answers a failed BLS call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.profiling.python_backend import pb_utils
from sidecar.profiling.vocabulary import ModelLookup, RawSpan
from sidecar.trace import schema
from sidecar.trace.spans import Level

MAX_DEPTH = 8  # BLS calls nested deeper than this answer with an error


@dataclass
class BlsCall:
    """One BLS call the replayed model made (`perf_counter_ns`; `depth` 0: the replayed
    model's own call, 1: a call made by the model it called, ...)."""

    model: str
    format: str
    start_ns: int
    end_ns: int
    error: str | None = None
    responses: int = 1
    depth: int = 0

    def span(self, offset_ns: int) -> RawSpan:
        """The call as a layer span on the epoch-ns clock (`offset_ns`: `epoch_offset_ns`)."""
        attrs: dict[str, Any] = {
            schema.BLS_MODEL: self.model,
            schema.BLS_FORMAT: self.format,
            schema.BLS_DEPTH: self.depth,
        }
        if self.error is not None:
            attrs[schema.BLS_ERROR] = self.error
        if self.responses != 1:
            attrs[schema.BLS_RESPONSES] = self.responses
        return RawSpan(
            Level.LAYER,
            f"bls:{self.model}",
            "bls",
            self.start_ns + offset_ns,
            self.end_ns + offset_ns,
            attributes=attrs,
        )


class OnnxCallee:
    """A called ONNX model, in ONNX Runtime on the CPU."""

    format = "onnx"

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]

    def infer(self, request: pb_utils.InferenceRequest) -> list[pb_utils.InferenceResponse]:
        feed = {t.name(): t.as_numpy() for t in request.inputs()}
        names = request.requested_output_names() or self.output_names
        values = self.session.run(names, feed)
        outputs = [pb_utils.Tensor(n, np.asarray(v)) for n, v in zip(names, values, strict=True)]
        return [pb_utils.InferenceResponse(outputs)]


class PythonCallee:
    """A called Python-backend model, run by its own `model.py`."""

    format = "python"

    def __init__(self, model: Any) -> None:
        self.model = model  # a `loader.PythonModel`

    def infer(self, request: pb_utils.InferenceRequest) -> list[pb_utils.InferenceResponse]:
        inner = self.model.request(
            {t.name(): t.as_numpy() for t in request.inputs()},
            request.requested_output_names() or None,
        )
        previous = pb_utils.bls_handler()
        pb_utils.set_bls_handler(self.model.bls_router)
        try:
            execution = self.model.execute(inner)
        finally:
            pb_utils.set_bls_handler(previous)
        return [r.response for r in execution.with_data() if r.response is not None]


@dataclass
class BlsRouter:
    """The BLS handler of one replayed model: resolves, loads (once) and runs called models."""

    repository: Path
    find: ModelLookup  # the repository's lookup (`vocabulary.ModelLookup`)
    depth: int = 0
    calls: list[BlsCall] = field(default_factory=list)
    _callees: dict[str, Any] = field(default_factory=dict)

    def __call__(
        self, request: pb_utils.InferenceRequest
    ) -> pb_utils.InferenceResponse | Iterator[pb_utils.InferenceResponse]:
        clock = time.perf_counter_ns
        t0 = clock()
        fmt = "unknown"
        try:
            callee = self.callee(request.model_name, request.model_version)
            fmt = callee.format
            responses = callee.infer(request)
            error = None
        except Exception as exc:
            error = f"BLS call to {request.model_name!r} cannot be replayed: {exc}"
            responses = [pb_utils.InferenceResponse(error=pb_utils.TritonError(error))]
        t1 = clock()
        call = BlsCall(request.model_name, fmt, t0, t1, error, len(responses), self.depth)
        self.calls.append(call)
        return responses[0] if len(responses) == 1 else iter(responses)

    def callee(self, model: str, version: int = -1) -> Any:
        if self.depth >= MAX_DEPTH:
            raise RecursionError(f"BLS calls nested deeper than {MAX_DEPTH}")
        if model in self._callees:
            return self._callees[model]
        from sidecar.profiling.formats import ModelFormat
        from sidecar.profiling.python_backend.loader import PythonModel

        location = self.find(self.repository, model, None if version in (-1, None) else version)
        if location.format is ModelFormat.ONNX:
            callee: Any = OnnxCallee(location.path)
        elif location.format is ModelFormat.PYTHON:
            inner = PythonModel(location)
            inner.bls_router = BlsRouter(self.repository, self.find, self.depth + 1, self.calls)
            callee = PythonCallee(inner)
        else:
            raise NotImplementedError(
                f"the replay runs ONNX and Python models called over BLS, not "
                f"{location.format.value} ({model!r})"
            )
        self._callees[model] = callee
        return callee

    def python_models(self) -> list[Any]:
        """The Python models loaded for BLS so far, the ones they called included."""
        found: list[Any] = []
        for callee in self._callees.values():
            if isinstance(callee, PythonCallee):
                found.append(callee.model)
                found += callee.model.bls_router.python_models()
        return found
