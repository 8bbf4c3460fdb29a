"""The replay configured as the server runs the model: what its `config.pbtxt` says, applied.

`read_config` parses a `config.pbtxt` with Triton's own protobuf (`model_config_pb2`, protobuf's
`text_format`). `replay_settings` turns the parsed `ModelConfig` into `ReplaySettings`: what
the runner applies (`OrtSettings` for ONNX Runtime, `TorchSettings` for TorchScript) and one
`SettingRecord` per setting seen, applied or not with the reason. Nothing here raises on a
value: an unknown parameter, a malformed number or an accelerator this machine cannot run is
a record that says "not applied" and why; only a file that does not parse is an error.

Precedence: the config wins over the replay's own defaults (the worker's one runtime thread,
`--no-optimizations` of `xsp-sidecar profile`), since the point is to measure the model as
the server runs it; the record says what it overrode.

Triton's ONNX Runtime backend (its README): `optimization.graph.level` -1 is ORT's BASIC
level, 1 EXTENDED, 2 DISABLE_ALL, anything else (0, absent) ALL; `execution_mode` 0 is
sequential, 1 parallel. Accelerators: `cpu_execution_accelerator` `openvino`,
`gpu_execution_accelerator` `tensorrt` and `cuda` with their parameters (`tensorrt_options`,
`cuda_options`). The PyTorch backend's parameters are `"true"`/`"false"` strings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.profiling.formats import ModelFormat
from sidecar.profiling.vocabulary import ProfilingError
from sidecar.trace import schema

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

ProviderOptions = tuple[tuple[str, str], ...]  # hashable provider options

GRAPH_LEVELS = {-1: "basic", 1: "extended", 2: "disable_all"}  # any other level: "all"
EXECUTION_MODES = {0: "sequential", 1: "parallel"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

ORT_BACKENDS = {"onnxruntime", "onnxruntime_onnx"}
TORCH_BACKENDS = {"pytorch", "pytorch_libtorch"}
# Triton parameters the replay knows but does not apply, with why.
_ORT_NOT_APPLIED = {
    "memory.enable_memory_arena_shrinkage": "arena shrinkage between runs is not replayed",
    "session.use_device_allocator_for_initializers": "initializer allocation is not replayed",
    "cudnn_conv_algo_search": "a deprecated top-level CUDA option: give it in the cuda "
    "accelerator's parameters",
    "gpu_mem_limit": "a deprecated top-level CUDA option: give it in the cuda accelerator's "
    "parameters",
    "arena_extend_strategy": "a deprecated top-level CUDA option: give it in the cuda "
    "accelerator's parameters",
    "do_copy_in_default_stream": "a deprecated top-level CUDA option: give it in the cuda "
    "accelerator's parameters",
}
_TORCH_NOT_APPLIED = {
    "INTRA_OP_THREAD_COUNT": "PyTorch's thread pools are per process: the worker keeps its own",
    "INTER_OP_THREAD_COUNT": "PyTorch's thread pools are per process: the worker keeps its own",
    "ENABLE_WEIGHT_SHARING": "the replay loads one instance",
    "ENABLE_CACHE_CLEANING": "the CUDA cache is not emptied between replayed runs",
}
TENSORRT_OPTIONS = {  # Triton's key -> the TensorRT provider's option (ORT backend README)
    "max_workspace_size_bytes": "trt_max_workspace_size",
    "int8_calibration_table_name": "trt_int8_calibration_table_name",
    "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table",
    **{
        key: key
        for key in (
            "trt_max_partition_iterations", "trt_min_subgraph_size", "trt_dla_enable",
            "trt_dla_core", "trt_engine_cache_enable", "trt_engine_cache_path",
            "trt_engine_cache_prefix", "trt_dump_subgraphs", "trt_force_sequential_engine_build",
            "trt_context_memory_sharing_enable", "trt_layer_norm_fp32_fallback",
            "trt_timing_cache_enable", "trt_timing_cache_path", "trt_force_timing_cache",
            "trt_detailed_build_log", "trt_build_heuristics_enable", "trt_sparsity_enable",
            "trt_builder_optimization_level", "trt_auxiliary_streams", "trt_tactic_sources",
            "trt_extra_plugin_lib_paths", "trt_profile_min_shapes", "trt_profile_max_shapes",
            "trt_profile_opt_shapes", "trt_cuda_graph_enable",
        )
    },
}  # fmt: skip
CUDA_OPTIONS = {
    "cudnn_conv_algo_search": {"0": "EXHAUSTIVE", "1": "HEURISTIC", "2": "DEFAULT"},
    "arena_extend_strategy": {"0": "kNextPowerOfTwo", "1": "kSameAsRequested"},
    "gpu_mem_limit": None,  # passed as given
    "do_copy_in_default_stream": None,
    "cudnn_conv_use_max_workspace": None,
    "cudnn_conv1d_pad_to_nc1d": None,
    "use_ep_level_unified_stream": None,
    "enable_cuda_graph": None,
    "tunable_op_enable": None,
    "tunable_op_tuning_enable": None,
}
PROVIDERS = {
    "openvino": "OpenVINOExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
}


class ServerConfigError(ProfilingError):
    """A `config.pbtxt` cannot be read or does not parse as a Triton model config."""


@dataclass(frozen=True)
class SettingRecord:
    """One setting of the server's config and what the replay did with it."""

    setting: str  # e.g. `parameters.intra_op_thread_count`, `gpu_execution_accelerator.tensorrt`
    value: str
    applied: bool
    reason: str = ""


@dataclass(frozen=True)
class OrtSettings:
    """What an ONNX Runtime session takes from the config; None: the runner's default."""

    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    execution_mode: str | None = None  # "sequential" | "parallel"
    enable_mem_arena: bool | None = None
    enable_mem_pattern: bool | None = None
    graph_level: str | None = None  # "disable_all" | "basic" | "extended" | "all"
    # accelerators' providers, in the order they go before the device's own provider
    providers: tuple[tuple[str, ProviderOptions], ...] = ()


@dataclass(frozen=True)
class TorchSettings:
    """What a TorchScript replay takes from the PyTorch backend's parameters."""

    inference_mode: bool | None = None  # False: `torch.no_grad()` instead
    jit_executor: bool | None = None  # `torch._C._jit_set_profiling_executor`
    jit_profiling: bool | None = None  # `torch._C._jit_set_profiling_mode`


@dataclass(frozen=True)
class ReplaySettings:
    """A model's server configuration as the replay runs it, and what became of each setting."""

    ort: OrtSettings = OrtSettings()
    torch: TorchSettings = TorchSettings()
    records: tuple[SettingRecord, ...] = field(default=(), compare=False)

    def record_dicts(self) -> list[dict[str, Any]]:
        """The `replay_settings` trace attribute."""
        return [asdict(r) for r in self.records]


def read_config(path: Path) -> model_config_pb2.ModelConfig:
    """Parse a `config.pbtxt` (protobuf text format) into Triton's `ModelConfig`."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        text = path.read_text()
    except OSError as exc:
        raise ServerConfigError(f"cannot read {path}: {exc.strerror}") from None
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ServerConfigError(f"{path} is not a valid Triton model config: {exc}") from None
    return config


def config_beside(model_path: Path) -> Path | None:
    """`<repo>/<name>/config.pbtxt` for a model file `<repo>/<name>/<version>/model.*`."""
    folder = model_path.resolve().parent
    candidate = folder.parent / "config.pbtxt"
    return candidate if folder.name.isdigit() and candidate.is_file() else None


def server_summary(config: Any) -> dict[str, Any]:
    """The `server_config` trace attribute: how the server runs the model (key names are read
    by the fidelity analysis: keep them)."""
    kinds = [_kind_name(g.kind) for g in config.instance_group]
    accelerators: list[str] = []
    if config.HasField("optimization"):
        ea = config.optimization.execution_accelerators
        accelerators = [
            a.name for a in (*ea.cpu_execution_accelerator, *ea.gpu_execution_accelerator)
        ]
    return {
        schema.BACKEND: config.backend or config.platform,
        schema.PLATFORM: config.platform,
        schema.INSTANCE_KIND: kinds[0] if kinds else "",
        schema.INSTANCE_COUNT: sum(max(int(g.count), 1) for g in config.instance_group),
        schema.GPUS: sorted({int(gpu) for g in config.instance_group for gpu in g.gpus}),
        schema.ACCELERATORS: accelerators,
        schema.MAX_BATCH_SIZE: int(config.max_batch_size),
        schema.DYNAMIC_BATCHING: config.HasField("dynamic_batching"),
        schema.PREFERRED_BATCH_SIZES: preferred_batch_sizes(config),
    }


def preferred_batch_sizes(config: Any) -> list[int]:
    if not config.HasField("dynamic_batching"):
        return []
    return [int(b) for b in config.dynamic_batching.preferred_batch_size]


def sweep_sizes(config: Any) -> list[int]:
    """The default batch sweep for a model the server batches: 1, the dynamic batcher's
    preferred sizes and `max_batch_size` (deduplicated, sorted); empty when it does not batch."""
    if int(config.max_batch_size) <= 0:
        return []
    sizes = {1, int(config.max_batch_size), *preferred_batch_sizes(config)}
    return sorted(b for b in sizes if b >= 1)


def batching_records(config: Any, how: str, applied: bool) -> list[SettingRecord]:
    """Records of `xsp-sidecar profile` for `max_batch_size` and the preferred batch sizes:
    `how` says what it did with them (its default sweep, or the sizes the user gave). A replay
    runs the sampled request's own batch and leaves these to `server_config`."""
    records = [SettingRecord("max_batch_size", str(int(config.max_batch_size)), applied, how)]
    if config.HasField("dynamic_batching"):
        sizes = ",".join(map(str, preferred_batch_sizes(config)))
        records.append(SettingRecord("dynamic_batching.preferred_batch_size", sizes, applied, how))
    return records


def replay_settings(
    config: Any,
    fmt: ModelFormat,
    *,
    device: str = "cpu",
    device_reason: str = "",
    available_providers: Sequence[str] = (),
    worker_threads: int | None = None,
    optimizations: bool = True,
) -> ReplaySettings:
    """What the replay of a model on `device` applies of its `config` (a `ModelConfig`).

    `available_providers` are ONNX Runtime's (`ort.get_available_providers()`); an accelerator
    whose provider is not among them is recorded as not applied. `worker_threads` and
    `optimizations` are the replay's own settings, named in a record the config overrides."""
    kind = (config.backend or config.platform).lower()
    records = _instance_records(config, device, device_reason)
    ort, torch = OrtSettings(), TorchSettings()
    params = {key: value.string_value for key, value in sorted(config.parameters.items())}
    if kind in ORT_BACKENDS and fmt is ModelFormat.ONNX:
        ort = _ort_settings(config, params, records, worker_threads, optimizations)
        ort = _with_accelerators(ort, config, device, available_providers, records)
        return ReplaySettings(ort, torch, tuple(records))
    if kind in TORCH_BACKENDS and fmt is ModelFormat.TORCHSCRIPT:
        torch = _torch_settings(params, device, records)
    elif fmt is ModelFormat.PYTHON:  # the model reads its own parameters
        why = "given to model.py in initialize's args['model_config'], as Triton gives them"
        records += [SettingRecord(f"parameters.{k}", v, True, why) for k, v in params.items()]
    else:
        why = f"a {kind or 'unknown'} backend parameter: the {fmt.value} replay does not apply it"
        records += [SettingRecord(f"parameters.{k}", v, False, why) for k, v in params.items()]
    why = f"not a setting the {fmt.value} replay applies (backend {kind or 'unknown'})"
    _accelerators_not_applied(config, records, why)
    if config.HasField("optimization") and config.optimization.HasField("graph"):
        level = str(int(config.optimization.graph.level))
        records.append(SettingRecord("optimization.graph.level", level, False, why))
    return ReplaySettings(ort, torch, tuple(records))


# -- instance groups ------------------------------------------------------------------------
def _kind_name(kind: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return str(model_config_pb2.ModelInstanceGroup.Kind.Name(kind))


def _instance_records(config: Any, device: str, reason: str) -> list[SettingRecord]:
    records = []
    on_gpu = device.startswith("cuda")
    for i, group in enumerate(config.instance_group):
        kind = _kind_name(group.kind)
        where = f"instance_group[{i}]"
        if kind == "KIND_GPU":
            gpus = ",".join(map(str, group.gpus)) or "0"
            records.append(SettingRecord(f"{where}.kind", kind, on_gpu, reason))
            records.append(SettingRecord(f"{where}.gpus", gpus, on_gpu, reason))
        else:
            records.append(SettingRecord(f"{where}.kind", kind, not on_gpu, reason))
    return records


# -- ONNX Runtime ---------------------------------------------------------------------------
def _int(value: str, low: int = 0) -> int | None:
    try:
        number = int(value.strip())
    except ValueError:
        return None
    return number if number >= low else None


def _bool(value: str) -> bool | None:
    text = value.strip().lower()
    return True if text in _TRUE else False if text in _FALSE else None


def _ort_settings(
    config: Any,
    params: Mapping[str, str],
    records: list[SettingRecord],
    worker_threads: int | None,
    optimizations: bool,
) -> OrtSettings:
    values: dict[str, Any] = {}
    for key, value in params.items():
        name = f"parameters.{key}"
        if key in ("intra_op_thread_count", "inter_op_thread_count"):
            threads = _int(value)
            if threads is None:
                records.append(SettingRecord(name, value, False, "not a count (0 or more)"))
                continue
            values[key.replace("thread_count", "threads")] = threads
            over = (
                f"config.pbtxt wins over the worker's {worker_threads} thread(s)"
                if key == "intra_op_thread_count" and worker_threads
                else ""
            )
            records.append(SettingRecord(name, value, True, over))
        elif key == "execution_mode":
            number = _int(value)
            mode = EXECUTION_MODES.get(number) if number is not None else None
            if mode is None:
                records.append(SettingRecord(name, value, False, "expected 0 (sequential) or 1"))
                continue
            values["execution_mode"] = mode
            records.append(SettingRecord(name, value, True, mode))
        elif key in ("enable_mem_arena", "enable_mem_pattern"):
            flag = _bool(value)
            if flag is None:
                records.append(SettingRecord(name, value, False, "expected 0 or 1"))
                continue
            values[key] = flag
            records.append(SettingRecord(name, value, True))
        elif key in _ORT_NOT_APPLIED:
            records.append(SettingRecord(name, value, False, _ORT_NOT_APPLIED[key]))
        else:
            records.append(SettingRecord(name, value, False, "unknown parameter"))
    if config.HasField("optimization") and config.optimization.HasField("graph"):
        level = int(config.optimization.graph.level)
        values["graph_level"] = GRAPH_LEVELS.get(level, "all")
        over = "" if optimizations else "; config.pbtxt wins over --no-optimizations"
        records.append(
            SettingRecord(
                "optimization.graph.level", str(level), True, values["graph_level"] + over
            )
        )
    return OrtSettings(**values)


def _accelerators(config: Any) -> list[tuple[str, Any]]:
    if not config.HasField("optimization"):
        return []
    ea = config.optimization.execution_accelerators
    return [("cpu_execution_accelerator", a) for a in ea.cpu_execution_accelerator] + [
        ("gpu_execution_accelerator", a) for a in ea.gpu_execution_accelerator
    ]


def _accelerators_not_applied(config: Any, records: list[SettingRecord], why: str) -> None:
    for where, acc in _accelerators(config):
        records.append(SettingRecord(f"{where}.{acc.name}", _params_text(acc), False, why))


def _params_text(acc: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(acc.parameters.items()))


def provider_for(
    name: str, params: Mapping[str, str], device_id: int = 0
) -> tuple[str, dict[str, str], list[tuple[str, str]]]:
    """ONNX Runtime's provider and options for a Triton accelerator, and the parameters it
    could not map (key, reason). Raises KeyError for an accelerator ORT has no provider for."""
    provider = PROVIDERS[name]
    options: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    if name == "openvino":
        options["device_type"] = "CPU"
        skipped = [(k, "unknown parameter") for k in params]
        return provider, options, skipped
    options["device_id"] = str(device_id)
    for key, value in sorted(params.items()):
        if name == "tensorrt" and key == "precision_mode":
            flag = {"FP16": "trt_fp16_enable", "INT8": "trt_int8_enable"}.get(value.upper())
            if flag is not None:
                options[flag] = "True"
            elif value.upper() != "FP32":
                skipped.append((key, "expected FP32, FP16 or INT8"))
        elif name == "tensorrt" and key in TENSORRT_OPTIONS:
            options[TENSORRT_OPTIONS[key]] = value
        elif name == "cuda" and key in CUDA_OPTIONS:
            table = CUDA_OPTIONS[key]
            if table is not None and value not in table and value not in table.values():
                skipped.append((key, f"expected one of {', '.join(table)}"))
                continue
            options[key] = table.get(value, value) if table is not None else value
        else:
            skipped.append((key, "unknown parameter"))
    return provider, options, skipped


def _with_accelerators(
    ort: OrtSettings,
    config: Any,
    device: str,
    available: Sequence[str],
    records: list[SettingRecord],
) -> OrtSettings:
    providers: list[tuple[str, ProviderOptions]] = []
    on_gpu = device.startswith("cuda")
    device_id = int(device.split(":")[1]) if on_gpu else 0
    for where, acc in _accelerators(config):
        setting, text = f"{where}.{acc.name}", _params_text(acc)
        if acc.name not in PROVIDERS:
            records.append(SettingRecord(setting, text, False, "unknown accelerator"))
            continue
        provider, options, skipped = provider_for(acc.name, dict(acc.parameters), device_id)
        if where == "gpu_execution_accelerator" and not on_gpu:
            records.append(
                SettingRecord(
                    setting, text, False, f"a GPU accelerator; the replay runs on {device}"
                )
            )
            continue
        if provider not in available:
            why = f"{provider} is not in this onnxruntime build (providers: {', '.join(available)})"
            records.append(SettingRecord(setting, text, False, why))
            continue
        records.append(SettingRecord(setting, text, True, provider))
        for key, why in skipped:
            records.append(SettingRecord(f"{setting}.{key}", acc.parameters[key], False, why))
        providers.append((provider, tuple(sorted(options.items()))))
    if not providers:
        return ort
    return OrtSettings(**{**asdict(ort), "providers": tuple(providers)})


# -- PyTorch --------------------------------------------------------------------------------
def _torch_settings(
    params: Mapping[str, str], device: str, records: list[SettingRecord]
) -> TorchSettings:
    import torch

    values: dict[str, bool] = {}
    fields = {
        "INFERENCE_MODE": ("inference_mode", None),
        "ENABLE_JIT_EXECUTOR": ("jit_executor", "_jit_set_profiling_executor"),
        "ENABLE_JIT_PROFILING": ("jit_profiling", "_jit_set_profiling_mode"),
    }
    for key, value in params.items():
        name = f"parameters.{key}"
        flag = _bool(value)
        if key == "DISABLE_OPTIMIZED_EXECUTION":
            if flag is None:
                records.append(SettingRecord(name, value, False, "expected true or false"))
            else:  # the runner always runs TorchScript with optimized execution off
                why = "" if flag else (
                    "the TorchScript replay runs with optimized execution off at every level "
                    "(module boundaries are visible only so)"
                )  # fmt: skip
                records.append(SettingRecord(name, value, flag, why))
        elif key in fields:
            attr, hook = fields[key]
            if flag is None:
                records.append(SettingRecord(name, value, False, "expected true or false"))
            elif hook is not None and not hasattr(torch._C, hook):
                records.append(
                    SettingRecord(name, value, False, f"torch {torch.__version__} has no {hook}")
                )
            else:
                values[attr] = flag
                records.append(SettingRecord(name, value, True))
        elif key == "ENABLE_NVFUSER":
            why = (
                f"nvFuser fuses CUDA kernels; the replay runs on {device}"
                if not device.startswith("cuda")
                else f"torch {torch.__version__}: TorchScript has no nvFuser (a no-op switch)"
            )
            records.append(SettingRecord(name, value, False, why))
        elif key in _TORCH_NOT_APPLIED:
            records.append(SettingRecord(name, value, False, _TORCH_NOT_APPLIED[key]))
        else:
            records.append(SettingRecord(name, value, False, "unknown parameter"))
    return TorchSettings(**values)
