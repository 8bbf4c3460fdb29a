"""A stand-in for Triton's `triton_python_backend_utils`, for replaying a model's `model.py`.

Written against the Python backend's documented API (triton-inference-server/python_backend
README and its `triton_python_backend_utils.py`): `Tensor`, `InferenceRequest` (with `exec()`
for BLS), `InferenceResponse`, `TritonError`, the response sender of decoupled models,
`Logger` and the config helpers. It is installed as `sys.modules["triton_python_backend_utils"]`
only inside the profiling worker, while a model's code runs (`python_backend.loader`).

What Triton does in C++ (shared memory, DLPack to GPU tensors, the scheduler) is not
reproduced: tensors are numpy arrays in the worker's memory. `InferenceRequest.exec()` goes
to the replay's BLS handler (`set_bls_handler`); without one it answers with an error.
`async_exec()` runs the same call in the event loop's default executor, as Triton's stub does,
and returns the future for an `async def execute` to await.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
_NUMPY_TO_TRITON = {np.dtype(v): k for k, v in TRITON_STRING_TO_NUMPY.items() if v is not bool}
_NUMPY_TO_TRITON[np.dtype(bool)] = "TYPE_BOOL"
_TYPE_NUMBERS = {name: i for i, name in enumerate(TRITON_STRING_TO_NUMPY, start=1)}


class TritonError(Exception):
    """An error a model returns in a response (or BLS returns to the model)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class Tensor:
    """A named tensor; the data is a numpy array (BYTES: an object array of bytes)."""

    def __init__(self, name: str, array: Any, dtype: Any = None) -> None:
        if not isinstance(name, str):
            raise TritonError(f"a tensor's name must be a str, got {type(name).__name__}")
        data = np.asarray(array)
        if data.dtype.kind in "SU":  # Triton keeps strings as bytes objects
            data = np.array([_as_bytes(x) for x in data.ravel()], dtype=np.object_).reshape(
                data.shape
            )
        self._name = name
        self._array = data

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return _TYPE_NUMBERS[numpy_to_triton_string(self._array.dtype)]

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> Tensor:
        """A tensor from anything numpy can take over DLPack (a CPU tensor)."""
        return cls(name, np.from_dlpack(capsule))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._array.dtype})"


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


class InferenceResponse:
    """A model's answer: its output tensors, or an error."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = parameters

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        import json

        return (
            self._parameters
            if isinstance(self._parameters, str)
            else json.dumps(self._parameters or {})
        )


ResponseSink = Callable[["InferenceResponse | None", int], None]


class InferenceResponseSender:
    """A decoupled model's sender: each `send` goes to the replay's sink with its flags."""

    def __init__(self, sink: ResponseSink) -> None:
        self._sink = sink
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonError("the response sender is closed: the final flag was sent")
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._closed = True
        self._sink(response, flags)

    def is_cancelled(self) -> bool:
        return False


BlsHandler = Callable[["InferenceRequest"], "InferenceResponse | Iterator[InferenceResponse]"]
_bls = threading.local()


def set_bls_handler(handler: BlsHandler | None) -> None:
    """Where `InferenceRequest.exec()` goes in this thread (the replay sets it)."""
    _bls.handler = handler


def bls_handler() -> BlsHandler | None:
    """The handler `set_bls_handler` set in this thread, if any."""
    return getattr(_bls, "handler", None)


class InferenceRequest:
    """A request: the model's input in `execute`, or a BLS call the model makes."""

    def __init__(
        self,
        model_name: str = "",
        inputs: Sequence[Tensor] | None = None,
        requested_output_names: Sequence[str] | None = None,
        model_version: int = -1,
        flags: int = 0,
        correlation_id: int | str = 0,
        request_id: str = "",
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
        sender: InferenceResponseSender | None = None,
    ) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self._inputs = list(inputs or [])
        self._requested = list(requested_output_names or [])
        self._flags = flags
        self._correlation_id = correlation_id
        self._request_id = request_id
        self._timeout = timeout
        self._parameters = parameters
        self._sender = sender

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        import json

        return (
            self._parameters
            if isinstance(self._parameters, str)
            else json.dumps(self._parameters or {})
        )

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonError("this request has no response sender (the model is not decoupled)")
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """A BLS call: the replay of `model_name` on these inputs (an iterator of responses
        when `decoupled`)."""
        return self._exec_with(bls_handler(), decoupled)

    def async_exec(self, decoupled: bool = False) -> asyncio.Future[Any]:
        """A BLS call for `async def execute`: as Triton's stub does, the call runs in the
        running event loop's default executor and the future it returns is awaited (several
        can be in flight at once, e.g. with `asyncio.gather`). Outside a running loop it
        raises `RuntimeError`, as Triton's does."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()  # the caller's recording of runtime sessions
        return loop.run_in_executor(None, context.run, self._exec_with, bls_handler(), decoupled)

    def _exec_with(self, handler: BlsHandler | None, decoupled: bool) -> Any:
        if handler is None:
            error = TritonError(f"BLS to {self.model_name!r}: no replay handles BLS calls here")
            response = InferenceResponse(error=error)
            return iter([response]) if decoupled else response
        result = handler(self)
        if decoupled:
            return iter([result]) if isinstance(result, InferenceResponse) else result
        if isinstance(result, InferenceResponse):
            return result
        return next(iter(result), InferenceResponse(error=TritonError("no response")))


class Logger:
    """Triton's `pb_utils.Logger`: the model's log lines go to the worker's log."""

    _log = logging.getLogger("sidecar.profiling.python_backend.model")

    @classmethod
    def log_info(cls, message: str) -> None:
        cls._log.info("%s", message)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls._log.warning("%s", message)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls._log.error("%s", message)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls._log.debug("%s", message)

    @classmethod
    def log(cls, message: str, level: int = 0) -> None:
        cls._log.info("%s", message)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def numpy_to_triton_string(dtype: Any) -> str:
    return _NUMPY_TO_TRITON[np.dtype(dtype)]


def triton_to_numpy_type(data_type: int) -> Any:
    names = {number: name for name, number in _TYPE_NUMBERS.items()}
    found = TRITON_STRING_TO_NUMPY.get(names.get(data_type, ""))
    return np.bool_ if found is bool else found


def numpy_to_triton_type(data_type: Any) -> int:
    return _TYPE_NUMBERS[numpy_to_triton_string(data_type)]


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """Triton's BYTES wire form: each element as a 4-byte little-endian length + its bytes."""
    if input_tensor.size == 0:
        return None
    parts = bytearray()
    for item in input_tensor.ravel(order="C"):
        raw = _as_bytes(item)
        parts += len(raw).to_bytes(4, "little") + raw
    return np.frombuffer(bytes(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    items, offset = [], 0
    while offset < len(encoded_tensor):
        size = int.from_bytes(encoded_tensor[offset : offset + 4], "little")
        offset += 4
        items.append(encoded_tensor[offset : offset + size])
        offset += size
    return np.array(items, dtype=np.object_)
