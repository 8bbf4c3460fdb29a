"""Load a Triton Python-backend model's `model.py` and run it as the backend would.

`PythonModel(location)` imports `<repo>/<model>/<version>/model.py` under a private module
name with the stand-in `pb_utils` installed as `triton_python_backend_utils` (only while the
model's code runs: import, `initialize`, `execute`, `finalize`), builds the `args` Triton
gives `initialize` (the config as JSON, as Triton's `model_config`), and calls `initialize`
once. `execute(inputs)` sends one request, as Triton does for an unbatched sampled request,
and collects every response: those `execute` returns, or for a decoupled model
(`model_transaction_policy { decoupled: true }`) each one sent through the request's
response sender, with its time, until the final flag.

This runs the repository's own Python code in the worker, as Triton runs it in its stub.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import inspect
import json
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from sidecar.profiling.python_backend import pb_utils
from sidecar.profiling.python_backend.runtime_sessions import Sessions, recording
from sidecar.profiling.vocabulary import ProfilingError

MODULE = "triton_python_backend_utils"
FINAL_WAIT_S = 30.0  # how long a decoupled model may send after `execute` returned
_swap_lock = threading.Lock()
_users = [0]  # `stand_in` blocks open, in every thread
_before: list[Any] = []  # what `sys.modules[MODULE]` was before the first one


class PythonModelError(ProfilingError):
    """The model's `model.py` cannot be loaded or run."""


@contextlib.contextmanager
def stand_in() -> Iterator[None]:
    """`import triton_python_backend_utils` gives the stand-in while the model's code runs
    (in any thread: a BLS `async_exec` runs a callee's code in another one while its caller
    waits, so no lock is held while the code runs)."""
    with _swap_lock:
        if _users[0] == 0:
            _before[:] = [sys.modules.get(MODULE)]
            sys.modules[MODULE] = pb_utils
        _users[0] += 1
    try:
        yield
    finally:
        with _swap_lock:
            _users[0] -= 1
            if _users[0] == 0:
                before = _before[0] if _before else None
                if before is None:
                    sys.modules.pop(MODULE, None)
                else:
                    sys.modules[MODULE] = before


def config_json(config: Any) -> dict[str, Any]:
    """A `ModelConfig` as the dict Triton's `model_config` JSON holds: proto field names,
    every field with its default, integers as numbers (protobuf's JSON writes int64 as
    strings; Triton's does not), and what Triton's auto-completion adds."""
    from google.protobuf.json_format import MessageToDict

    # Triton's JSON has every field, defaults included (the keyword was renamed in 5.26)
    keyword = "always_print_fields_with_no_presence"
    if "including_default_value_fields" in inspect.signature(MessageToDict).parameters:
        keyword = "including_default_value_fields"
    options: dict[str, Any] = {"preserving_proto_field_name": True, keyword: True}
    raw = MessageToDict(config, **options)
    data = _numbers(raw)
    data.setdefault("name", "")
    data.setdefault("max_batch_size", 0)
    return _completed(data)


def _completed(data: dict[str, Any]) -> dict[str, Any]:
    """What Triton's config auto-completion adds for a Python-backend model, as its JSON
    shows it to `initialize` (observed on Triton 2.51)."""
    data["default_model_filename"] = data.get("default_model_filename") or "model.py"
    groups = data.get("instance_group") or [_default_group()]
    for i, group in enumerate(groups):
        group["name"] = group.get("name") or f"{data['name']}_{i}"
        group["count"] = group.get("count") or 1
    data["instance_group"] = groups
    data.setdefault("version_policy", {"latest": {"num_versions": 1}})
    data.setdefault(
        "optimization",
        {
            "eager_batching": False,
            "gather_kernel_buffer_threshold": 0,
            "input_pinned_memory": {"enable": True},
            "output_pinned_memory": {"enable": True},
            "priority": "PRIORITY_DEFAULT",
        },
    )
    return data


def _default_group() -> dict[str, Any]:
    return {
        "count": 1,
        "gpus": [],
        "host_policy": "",
        "kind": "KIND_CPU",
        "name": "",
        "passive": False,
        "profile": [],
        "secondary_devices": [],
    }


def _numbers(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _numbers(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v, key) for v in value]
    if isinstance(value, str) and key in ("dims", "shape") and value.lstrip("-").isdigit():
        return int(value)
    return value


@dataclass
class Response:
    """One response of a replayed request and when it came (ns after `execute` was called)."""

    response: pb_utils.InferenceResponse | None
    at_ns: int
    flags: int = 0

    def outputs(self) -> dict[str, np.ndarray]:
        if self.response is None:
            return {}
        return {t.name(): t.as_numpy() for t in self.response.output_tensors()}

    @property
    def error(self) -> str | None:
        if self.response is None or self.response.error() is None:
            return None
        error = self.response.error()
        return error.message() if error is not None else None


@dataclass
class Execution:
    """What one `execute` call produced; times are ns after it was called."""

    responses: list[Response] = field(default_factory=list)
    started_ns: int = 0  # `perf_counter_ns` when `execute` was called
    returned_ns: int = 0  # when `execute` returned
    done_ns: int = 0  # when the last response (or the final flag) came, or the return

    def with_data(self) -> list[Response]:
        """The responses that carry outputs or an error (not a bare final flag)."""
        return [r for r in self.responses if r.response is not None]


class PythonModel:
    """A Python-backend model loaded in this process, `initialize`d once."""

    def __init__(self, location: Any) -> None:
        """`location`: the model's `ModelLocation` (`backends.model_repository`), whose `path`
        is its `model.py` and `config` its parsed `config.pbtxt`."""
        self.name: str = location.name
        self.version: str = location.version
        self.path = Path(location.path)
        self.sessions = Sessions()  # the ONNX Runtime sessions its code makes
        self.config = config_json(location.config) if location.config is not None else {}
        self.config.setdefault("name", self.name)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.config)
        self.output_names = [o["name"] for o in self.config.get("output", [])]
        self.module = self._import()
        if not hasattr(self.module, "TritonPythonModel"):
            raise PythonModelError(f"{self.path} defines no TritonPythonModel class")
        with self.running():
            try:
                self.instance = self.module.TritonPythonModel()
                if hasattr(self.instance, "initialize"):
                    self.instance.initialize(self.args())
            except Exception as exc:
                raise PythonModelError(
                    f"{self.name}: model.py initialize failed: {type(exc).__name__}: {exc}"
                ) from exc
        self.execute_code = self.instance.execute.__code__
        self.bls_router: Any = None  # where this model's BLS calls go (`bls.BlsRouter`)
        self._loop: asyncio.AbstractEventLoop | None = None  # for an `async def execute`

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the model's own code runs: the stand-in `pb_utils`, and its ONNX Runtime
        sessions recorded (`runtime_sessions`)."""
        with stand_in(), recording(self.sessions):
            yield

    def args(self) -> dict[str, str]:
        """The `args` of `initialize`, as Triton's Python backend gives them (CPU instance)."""
        return {
            "model_config": json.dumps(self.config),
            "model_instance_kind": "CPU",
            "model_instance_name": f"{self.name}_0_0",
            "model_instance_device_id": "0",
            "model_repository": str(self.path.parent.parent),
            "model_version": self.version,
            "model_name": self.name,
        }

    def _import(self) -> ModuleType:
        digest = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:12]
        module_name = f"xsp_python_model_{digest}"
        spec = importlib.util.spec_from_file_location(module_name, self.path)
        if spec is None or spec.loader is None:
            raise PythonModelError(f"cannot import {self.path}")
        module = importlib.util.module_from_spec(spec)
        with self.running():
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                sys.modules.pop(module_name, None)
                raise PythonModelError(
                    f"{self.name}: importing model.py failed: {type(exc).__name__}: {exc}"
                ) from exc
        return module

    def request(
        self, inputs: Mapping[str, np.ndarray], requested: list[str] | None = None
    ) -> pb_utils.InferenceRequest:
        tensors = [pb_utils.Tensor(name, array) for name, array in inputs.items()]
        return pb_utils.InferenceRequest(
            model_name=self.name,
            inputs=tensors,
            requested_output_names=requested or self.output_names,
        )

    def execute(self, request: pb_utils.InferenceRequest) -> Execution:
        """Run `execute([request])` and collect its responses."""
        out = Execution()
        final = threading.Event()
        clock = time.perf_counter_ns
        t0 = out.started_ns = clock()

        def sink(response: pb_utils.InferenceResponse | None, flags: int) -> None:
            out.responses.append(Response(response, clock() - t0, flags))
            if flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                final.set()

        if self.decoupled:
            request._sender = pb_utils.InferenceResponseSender(sink)
        with self.running():
            try:
                returned = self.instance.execute([request])
                if inspect.isawaitable(returned):  # `async def execute`, as Triton runs it
                    returned = self._event_loop().run_until_complete(returned)
            except Exception as exc:
                raise PythonModelError(
                    f"{self.name}: model.py execute raised {type(exc).__name__}: {exc}"
                ) from exc
        out.returned_ns = clock() - t0
        if self.decoupled:
            if not final.wait(FINAL_WAIT_S):
                raise PythonModelError(
                    f"{self.name}: the decoupled model sent no final flag within "
                    f"{FINAL_WAIT_S:g} s of execute returning"
                )
        else:
            for response in returned or []:
                out.responses.append(Response(response, out.returned_ns))
            if len(out.responses) != 1:
                raise PythonModelError(
                    f"{self.name}: execute returned {len(out.responses)} responses for 1 request"
                )
        out.done_ns = max([out.returned_ns, *(r.at_ns for r in out.responses)])
        return out

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The model's own event loop (Triton's stub keeps one per model instance)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def finalize(self) -> None:
        """Call the model's `finalize` (as Triton does when it unloads the model), then close
        its event loop; a second call does nothing."""
        if getattr(self, "_finalized", False):
            return
        self._finalized = True
        try:
            if hasattr(self.instance, "finalize"):
                with self.running():
                    self.instance.finalize()
        finally:
            if self._loop is not None:
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
                self._loop.close()
                self._loop = None
