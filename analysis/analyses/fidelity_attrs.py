"""What one trace's attributes say about the replay's fidelity (`analysis.analyses.fidelity`'s rules
per trace): the live compute time the store kept, the server's batch window, the differences
between the server and the replay. Plain Python over the decoded attributes, no pandas: the
Parquet export (`analysis.fleet.export`) runs it once per trace."""

from __future__ import annotations

from typing import Any

from sidecar.trace import schema

PYTHON_BACKEND = "python"
ONNXRUNTIME_BACKEND = "onnxruntime"


def _attrs(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def request_fields(attrs: dict[str, Any]) -> dict[str, Any]:
    """What one trace's attributes say for its row of `per_request` (the fleet export keeps
    these as columns): whether the store kept its `fidelity` attribute, the live compute time
    and its source, the server's batch window and the causes (`_causes`)."""
    fid = _attrs(attrs.get(schema.FIDELITY))
    window = _attrs(fid.get(schema.SERVER_BATCH_WINDOW))
    return {
        "fidelity_kept": bool(fid),
        "live_ns": number(fid.get(schema.LIVE_COMPUTE_NS)),
        schema.LIVE_SOURCE: fid.get(schema.LIVE_SOURCE),
        "server_batch_sizes": sorted(int(s) for s in _attrs(window.get(schema.WINDOW_BATCH_SIZES))),
        "window_executions": number(window.get(schema.WINDOW_EXECUTIONS)),
        "window_note": window.get(schema.WINDOW_UNOBSERVED),
        "causes": _causes(attrs),
    }


def number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return float("nan")
    return float(value)


def _causes(attrs: dict[str, Any]) -> list[tuple[str, bool]]:
    """What the trace says differs between the server and the replay: (cause, whether the
    server and the replay still run the same kernels)."""
    server = _attrs(attrs.get(schema.SERVER_CONFIG))
    out: list[tuple[str, bool]] = []
    backend = str(server.get(schema.BACKEND) or attrs.get(schema.BACKEND) or "")
    if backend == PYTHON_BACKEND and attrs.get(schema.MODEL_FORMAT) == PYTHON_BACKEND:
        out.append((
            "the server runs model.py in the Python backend's stub process (IPC and tensor "
            "copies through shared memory); the replay runs the same model.py in the "
            "profiling worker, without them", True,
        ))  # fmt: skip
    elif backend == PYTHON_BACKEND:
        out.append((
            "the server runs the model inside a Python-backend model (its stub process, IPC "
            "and tensor copies); the replay runs only the model file", True,
        ))  # fmt: skip
    kind = str(server.get(schema.INSTANCE_KIND) or "")
    replay_device = str(attrs.get(schema.REPLAY_DEVICE) or "")
    on_gpu = replay_device.startswith("cuda")
    if kind == "KIND_GPU" and not on_gpu and replay_device:
        out.append(("the server runs on a GPU (KIND_GPU), the replay on the CPU", False))
    elif kind == "KIND_CPU" and on_gpu:
        out.append(("the server runs on the CPU (KIND_CPU), the replay on a GPU", False))
    threads = attrs.get(schema.INTRA_OP_THREADS)
    settings = [_attrs(x) for x in attrs.get(schema.REPLAY_SETTINGS) or []]
    set_threads = any(x.get(schema.SETTING, "").endswith("intra_op_thread_count") for x in settings)
    if backend == ONNXRUNTIME_BACKEND and not set_threads and isinstance(threads, int) and threads:
        out.append((
            "the server's ONNX Runtime runs with its default intra-op threads (config.pbtxt "
            f"sets none: one per core), the replay with {threads}", True,
        ))  # fmt: skip
    for setting in attrs.get(schema.REPLAY_SETTINGS) or []:
        s = _attrs(setting)
        if s and not s.get(schema.APPLIED, True):
            name, why = str(s.get(schema.SETTING, "?")), str(s.get(schema.REASON, ""))
            accelerator = "accelerator" in name
            value = (
                f" = {s[schema.SETTING_VALUE]}"
                if s.get(schema.SETTING_VALUE) not in (None, "")
                else ""
            )
            out.append((
                f"the server's {name}{value} is not applied by the replay ({why})",
                not accelerator,
            ))  # fmt: skip
    return out
