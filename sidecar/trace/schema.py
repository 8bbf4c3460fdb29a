"""The trace's contract in one place: the store's schema version, the span levels and sources,
a trace's statuses, and every span and trace attribute the sidecar writes and `analysis/`
reads, each with its type and a one-line meaning.

Producers and readers import these names instead of spelling them (`attributes[OP_TYPE]`,
`f"json_extract(attributes, '{json_path(FIDELITY)}')"`); `tests/trace/test_schema.py` fails
when a module of `sidecar/` or `analysis/` uses an attribute or level name this module does
not declare, or spells a declared one itself. `docs/trace-schema.md`'s tables of levels and
attributes are generated from here: `python -m sidecar.trace.schema --markdown`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import StrEnum

SCHEMA_VERSION = 2
"""`PRAGMA user_version` of a fully migrated store: `migrations.MIGRATIONS.latest_version`."""

# `Trace.status` values
OK = "ok"
ERROR = "error"
LIVE_ONLY = "live_only"


class Level(StrEnum):
    """Where a span sits in the across-stack hierarchy."""

    REQUEST = "request"  # live: the call as the proxy saw it
    SERVER = "server"  # live: the backend's own spans (Triton request, queue, compute, ...)
    MODEL = "model"  # replay M: one model execution
    LAYER = "layer"  # replay L: a framework node / op / module
    KERNEL = "kernel"  # replay K: GPU kernel, memcpy, CUDA API call, or CPU library op

    @property
    def depth(self) -> int:
        """Replay depth (M=0, L=1, K=2); live levels have no depth (-1)."""
        return _DEPTH.get(self, -1)


REPLAY_LEVELS: tuple[Level, ...] = (Level.MODEL, Level.LAYER, Level.KERNEL)
_DEPTH = {Level.MODEL: 0, Level.LAYER: 1, Level.KERNEL: 2}
LEVEL_CODES = {"M": Level.MODEL, "L": Level.LAYER, "K": Level.KERNEL}
LEVEL_MEANINGS: dict[Level, str] = {
    Level.REQUEST: "the call as the proxy saw it (gRPC or HTTP); `kind` = its method label",
    Level.SERVER: "the backend's own spans (Triton's, TF-Serving's `tf_op`s; see below)",
    Level.MODEL: "one model execution in the leveled replay",
    Level.LAYER: "a framework node / op / module; `kind` = op type (`Conv`, `aten::addmm`, ...)",
    Level.KERNEL: "GPU kernel, memcpy, memset, CUDA runtime/driver call, or a CPU library op",
}


class Source(StrEnum):
    """Where a span's numbers were measured."""

    PROXY = "proxy"
    BACKEND = "backend"
    REPLAY = "replay"


class KernelKind(StrEnum):
    """A kernel-level span's `kind`."""

    KERNEL = "kernel"  # a GPU kernel
    MEMCPY = "memcpy"
    MEMSET = "memset"
    RUNTIME = "runtime"  # a CUDA runtime API call
    DRIVER = "driver"  # a CUDA driver API call
    CPU_OP = "cpu_op"  # a CPU library op a layer calls


# Server-level span kinds: Triton's phases of a request (`live.triton_spans`), the compute span
# of the model's execution among them, and TF-Serving's op spans (`live.tf_profiler`)
COMPUTE_INFER = "compute_infer"
TRITON_PHASES = ("queue", "compute_input", COMPUTE_INFER, "compute_output")
TF_OP = "tf_op"  # one TensorFlow op kernel of a TF-Serving request's run


@dataclass(frozen=True)
class Attribute:
    """One JSON key of a span's or a trace's `attributes` (or of an attribute's object)."""

    name: str
    on: str  # "trace", a level's name, "a/b" for several, or the attribute holding it
    type: str  # JSON type: int, float, bool, str, list, object, any
    meaning: str


ATTRIBUTES: dict[str, Attribute] = {}
TRACE = "trace"
_SPANS = "span"  # any level


def _key(on: str, name: str, type_: str, meaning: str) -> str:
    """Declare one attribute key (once); its name is the constant's value."""
    if name in ATTRIBUTES:
        raise ValueError(f"attribute {name!r} declared twice")
    ATTRIBUTES[name] = Attribute(name, on, type_, meaning)
    return name


def json_path(name: str) -> str:
    """SQLite's / DuckDB's JSON path of a top-level attribute: `$.name`."""
    return f"$.{name}"


_R, _S = Level.REQUEST.value, Level.SERVER.value
_M, _L, _K = Level.MODEL.value, Level.LAYER.value, Level.KERNEL.value
_LK = f"{_L}/{_K}"

# --- request spans: the relay's view of a live call ---------------------------------------
GRPC_CODE = _key(_R, "grpc_code", "int", "the call's gRPC status code (HTTP: its status's class)")
GRPC_MESSAGE = _key(_R, "grpc_message", "str", "the call's grpc-message")
REQUEST_BYTES = _key(_R, "request_bytes", "int", "bytes of the request's DATA frames / body")
RESPONSE_BYTES = _key(_R, "response_bytes", "int", "bytes of the response's DATA frames / body")
PATH = _key(_R, "path", "str", "the call's :path (/package.Service/Method); HTTP: its path")
PROTOCOL = _key(_R, "protocol", "str", "the relay that saw the call: `grpc` or `http`")
MODEL = _key(f"{_R}/{_S}", "model", "str", "the model the request names")
SIGNATURE_NAME = _key(_R, "signature_name", "str", "TF-Serving: the request's signature")
VERSION_LABEL = _key(_R, "version_label", "str", "TF-Serving: the request's version label")
RELAY_REQUEST_START_NS = _key(_R, "relay_request_start_ns", "int", "epoch ns: request began")
RELAY_REQUEST_END_NS = _key(_R, "relay_request_end_ns", "int", "epoch ns: request's last frame")
RELAY_RESPONSE_START_NS = _key(
    _R, "relay_response_start_ns", "int", "epoch ns: the response's first frame came back"
)
RELAY_RESPONSE_END_NS = _key(_R, "relay_response_end_ns", "int", "epoch ns: response ended")
RELAY_MARKS = (
    RELAY_REQUEST_START_NS,
    RELAY_REQUEST_END_NS,
    RELAY_RESPONSE_START_NS,
    RELAY_RESPONSE_END_NS,
)
STREAM_MESSAGE = _key(_R, "stream_message", "bool", "one message of an inference stream")
RESPONSES = _key(_R, "responses", "int", "responses to a stream message (BLS: the call's)")
FIRST_RESPONSE_NS = _key(_R, "first_response_ns", "int", "epoch ns of a message's first response")
LAST_RESPONSE_NS = _key(_R, "last_response_ns", "int", "epoch ns of a message's last response")
RESPONSE_GAPS_NS = _key(_R, "response_gaps_ns", "list", "ns between responses (at most 256)")
SERVER_BATCH_WINDOW = _key(
    _R, "server_batch_window", "object", "what the server executed around the request"
)
# its keys (`sampling.batch_windows`)
WINDOW_INFERENCES = _key(SERVER_BATCH_WINDOW, "inferences", "int", "requests computed")
WINDOW_EXECUTIONS = _key(SERVER_BATCH_WINDOW, "executions", "int", "batches run")
WINDOW_BATCH_SIZES = _key(SERVER_BATCH_WINDOW, "batch_sizes", "object", '{"<size>": executions}')
WINDOW_CLOSED_AFTER_RESPONSE_MS = _key(
    SERVER_BATCH_WINDOW, "closed_after_response_ms", "float", "second read's lag after response"
)
WINDOW_UNOBSERVED = _key(SERVER_BATCH_WINDOW, "unobserved", "str", "why there is no window")

# --- server spans: the backend's own ------------------------------------------------------
EVENTS = _key(_S, "events", "list", "Triton: the OTLP span's events ({name, time_ns})")
OTEL_SPAN_KIND = _key(_S, "otel_span_kind", "int", "Triton: the OTLP span kind")
SERVICE = _key(_S, "service", "str", "Triton: the OTLP resource's service.name")
STATUS_CODE = _key(_S, "status_code", "int", "Triton: the OTLP span's status code")
STATUS_MESSAGE = _key(_S, "status_message", "str", "Triton: the OTLP span's status message")
DERIVED_FROM = _key(_S, "derived_from", "str", "what a made span was derived from")
NAME_SCOPE = _key(_S, "name_scope", "str", "TF-Serving: the op's name scope (Keras layers)")
THREAD = _key(_S, "thread", "str", "TF-Serving: the thread the op ran on")
CAPTURE_SESSION = _key(_S, "capture_session", "str", "TF-Serving: the profiler capture")

# --- model, layer and kernel spans: the replay ----------------------------------------------
OP_TYPE = _key(f"{_S}/{_L}/{_K}", "op_type", "str", "operator type (a layer's also in `kind`)")
RUNTIME_OP_TYPE = _key(_L, "runtime_op_type", "str", "the op type as the runtime named it")
INPUT_SHAPES = _key(_L, "input_shapes", "list", "the inputs' shapes (lists of ints)")
OUTPUT_SHAPES = _key(_L, "output_shapes", "list", "the outputs' shapes (lists of ints)")
DTYPE = _key(_L, "dtype", "str", "the layer's element type")
PROVIDER = _key(_LK, "provider", "str", "execution provider / device that ran it")
RUNTIME = _key(_K, "runtime", "str", "Python model: the runtime that ran a K op")
ACTIVATION_BYTES = _key(_LK, "activation_bytes", "int", "activation memory (XSP A2)")
PARAMETER_BYTES = _key(_LK, "parameter_bytes", "int", "weights' memory (XSP A4)")
OUTPUT_BYTES = _key(_LK, "output_bytes", "int", "outputs' memory")
ALLOCATED_BYTES = _key(_L, "allocated_bytes", "int", "memory allocated (XSP A7)")
FLOPS = _key(_LK, "flops", "float", "floating-point operations (multiply-add = 2)")
FLOPS_ESTIMATED = _key(_L, "flops_estimated", "bool", "FLOPs estimated from op and shapes")
FLOPS_OPS_ESTIMATED = _key(_L, "flops_ops_estimated", "str", "TF: ops estimated, `n of m`")
DRAM_READ_BYTES = _key(_LK, "dram_read_bytes", "float", "bytes read from DRAM")
DRAM_WRITE_BYTES = _key(_LK, "dram_write_bytes", "float", "bytes written to DRAM")
BYTES_ESTIMATED = _key(_L, "bytes_estimated", "bool", "memory traffic estimated")
PARENT_AMBIGUOUS = _key(_SPANS, "parent_ambiguous", "bool", "parent not decided by containment")
PARENT_CANDIDATES = _key(_SPANS, "parent_candidates", "int", "spans that could be the parent")
PARENT_MISSING = _key(_SPANS, "parent_missing", "bool", "no span one level up contains it")
ORIGINAL_NODES = _key(_L, "original_nodes", "list", "graph nodes of a fused / renamed node")
ORIGINAL_OP_TYPES = _key(_L, "original_op_types", "list", "op types of those nodes")
OUTSIDE_LAYERS = _key(_L, "outside_layers", "bool", "TF: ops run outside any Keras layer")
TF_NODE = _key(_L, "tf_node", "str", "TF: the graph node of the layer")
TF_OP_TYPES = _key(_L, "tf_op_types", "list", "TF: the op types a layer ran")
TF_OPS = _key(_L, "tf_ops", "int", "TF: how many ops a layer ran")
SCOPE = _key(_L, "scope", "str", "TF: the layer's name scope")
LAYER = _key(_L, "layer", "str", "TF: the Keras layer a span belongs to")
LAYER_CLASS_SOURCE = _key(_L, "layer_class_source", "str", "TF: where the layer class came from")
DOMINANT_OP = _key(_L, "dominant_op", "str", "PyTorch: the module's longest aten op")
GPU_TIME_NS = _key(_L, "gpu_time_ns", "int", "PyTorch: the module's GPU time")
MODEL_GPU_TIME_NS = _key(TRACE, "model_gpu_time_ns", "int", "PyTorch: the M run's GPU time")
PYTHON_LAYER_METHOD = _key(_L, "python_layer_method", "str", "Python model: the method timed")
CALL_DEPTH = _key(_L, "call_depth", "int", "Python model: nesting of a BLS call")
BLS_MODEL = _key(_L, "bls_model", "str", "Python model: the model a BLS call ran")
BLS_FORMAT = _key(_L, "bls_format", "str", "Python model: that model's format")
BLS_DEPTH = _key(_L, "bls_depth", "int", "Python model: BLS nesting depth")
BLS_ERROR = _key(_L, "bls_error", "str", "Python model: the BLS call's error")
BLS_RESPONSES = _key(_L, "bls_responses", "int", "Python model: a decoupled call's responses")
RESPONSE_ERROR = _key(_M, "response_error", "str", "Python model: an error response's text")
TIME_TO_FIRST_RESPONSE_NS = _key(_M, "time_to_first_response_ns", "int", "decoupled: first reply")
EXECUTE_RETURNED_NS = _key(_M, "execute_returned_ns", "int", "when execute() returned")
ENSEMBLE_STEP = _key(_M, "ensemble_step", "str", "an ensemble step's model span: its step key")
STEP_INDEX = _key(_M, "step_index", "int", "an ensemble step's position")
DURATION_SOURCE = _key(_M, "duration_source", "str", "where the model span's duration came from")
DURATION_NOTE = _key(_SPANS, "duration_note", "str", "a note on how the duration was taken")
CORRELATION_ID = _key(_K, "correlation_id", "int", "CUPTI correlation id (launch to work)")
DEVICE = _key(f"{TRACE}/{_M}/{_K}", "device", "str", "the device that ran it")
STREAM = _key(_K, "stream", "int", "CUDA stream")
GRID = _key(_K, "grid", "list", "grid dimensions")
BLOCK = _key(_K, "block", "list", "block dimensions")
BYTES = _key(_K, "bytes", "int", "a memcpy's / memset's bytes")
COPY_KIND = _key(_K, "copy_kind", "str", "a memcpy's direction")
CBID = _key(_K, "cbid", "int", "a CUDA API call's callback id")
MANGLED_NAME = _key(_K, "mangled_name", "str", "the kernel's mangled name")
SHORT_NAME = _key(_K, "short_name", "str", "the kernel's short name")
REGISTERS_PER_THREAD = _key(_K, "registers_per_thread", "int", "a kernel's registers per thread")
STATIC_SHARED_MEMORY = _key(_K, "static_shared_memory", "int", "its static shared memory")
DYNAMIC_SHARED_MEMORY = _key(_K, "dynamic_shared_memory", "int", "its dynamic shared memory")
NCU_DURATION_NS = _key(_K, "ncu_duration_ns", "int", "its duration as Nsight Compute timed it")
ACHIEVED_OCCUPANCY = _key(_K, "achieved_occupancy", "float", "achieved occupancy (0..1)")
METRICS_ESTIMATED = _key(_K, "metrics_estimated", "bool", "counters estimated, not measured")
METRICS_SOURCE = _key(_K, "metrics_source", "str", "where the counters came from")
METRICS_RUN = _key(_K, "metrics_run", "bool", "from the metrics run (Nsight Compute)")
NCU_KERNEL_ID = _key(_K, "ncu_kernel_id", "int", "Nsight Compute's kernel id")
ESTIMATED_BECAUSE = _key(_K, "estimated_because", "str", "why the counters are estimated")
TENSOR_FLOPS = _key(_K, "tensor_flops", "float", "FLOPs on tensor cores")
TENSOR_PIPE_INSTRUCTIONS = _key(_K, "tensor_pipe_instructions", "float", "tensor-pipe instrs")
TENSOR_FLOPS_PER_INSTRUCTION = _key(
    _K, "tensor_flops_per_instruction", "float", "FLOPs per tensor-pipe instruction"
)
LAUNCH_SPAN_ID = _key(_K, "launch_span_id", "str", "the runtime/driver call that launched it")
LAUNCH_NAME = _key(_K, "launch_name", "str", "that call's name")
LAUNCHED_BY_GRAPH = _key(_K, "launched_by_graph", "bool", "launched by a CUDA graph replay")
GRAPH_ID = _key(_K, "graph_id", "int", "the CUDA graph")
GRAPH_NODE_ID = _key(_K, "graph_node_id", "int", "the CUDA graph node")
GRAPH_NODE_IDS = _key(_K, "graph_node_ids", "list", "graph nodes of a graph replay")
GRAPH_NODE_LAYER = _key(_K, "graph_node_layer", "str", "the layer a graph node was captured in")
GRAPH_NODE_LAYERS = _key(_K, "graph_node_layers", "object", "graph node -> layer")
GRAPH_NODE_SOURCE = _key(_K, "graph_node_source", "str", "how the graph node's layer was found")
GRAPH_LAUNCH_CORRELATION_ID = _key(
    _K, "graph_launch_correlation_id", "int", "correlation id of the graph's launch"
)
HOST_START_NS = _key(_LK, "host_start_ns", "int", "host clock start (GPU attribution)")
HOST_END_NS = _key(_LK, "host_end_ns", "int", "host clock end (GPU attribution)")
PARENT_LAYER = _key(_LK, "parent_layer", "str", "the enclosing layer's name")
MODULE = _key(_LK, "module", "str", "PyTorch: the module path")
DEPTH = _key(_LK, "depth", "int", "nesting depth of a module / call")
LEAF = _key(_L, "leaf", "bool", "a module without child modules")
GPU_POSITION = _key(_L, "gpu_position", "int", "a layer's order on the GPU timeline")
TIME_BASE = _key(_LK, "time_base", "str", "the clock the span's times were taken on")
KERNEL_COUNT = _key(_L, "kernel_count", "int", "kernels attributed to the layer")
KERNEL_NS = _key(_L, "kernel_ns", "int", "their summed time")
ACTIVITY_COUNT = _key(_L, "activity_count", "int", "GPU activities attributed to the layer")

# --- trace attributes ---------------------------------------------------------------------
INPUTS = _key(TRACE, "inputs", "list", "the inputs: {name, shape, dtype, digest}")
RAW_INPUTS = _key(TRACE, "raw_inputs", "object", "the request's tensors (--store-raw-inputs)")
INPUT_SOURCE = _key(TRACE, "input_source", "str", "`request` or `random` (admin profiles)")
METHOD = _key(
    TRACE, "method", "str",
    "the sampled call's job method: its gRPC method, or Http<method> for a REST call",
)  # fmt: skip
REQUEST_SPAN_ID = _key(TRACE, "request_span_id", "str", "the proxy's span of the request")
RECEIVED_NS = _key(TRACE, "received_ns", "int", "epoch ns the relay received the request")
REPLAY = _key(TRACE, "replay", "str", "live-only traces: `not_replayable: <reason>`")
MODEL_PATH = _key(TRACE, "model_path", "str", "the model file replayed")
MODEL_FORMAT = _key(TRACE, "model_format", "str", "its format (onnx, torchscript, python, ...)")
BACKEND = _key(TRACE, "backend", "str", "the serving backend of the model")
REPLAY_DEVICE = _key(TRACE, "replay_device", "str", "where the replay ran (cpu, cuda:0, ...)")
REPLAY_DEVICE_REASON = _key(TRACE, "replay_device_reason", "str", "why the replay ran there")
DEVICE_REASON = _key(_M, "device_reason", "str", "why the replay ran on that device")
REPLAY_SETTINGS = _key(TRACE, "replay_settings", "list", "config.pbtxt's settings, applied or not")
SERVER_CONFIG = _key(TRACE, "server_config", "object", "how the server runs the model")
INTRA_OP_THREADS = _key(TRACE, "intra_op_threads", "int", "the replay's intra-op threads")
PEAK_FLOPS_PER_S = _key(TRACE, "peak_flops_per_s", "float", "the device's FLOP/s roof")
PEAK_DRAM_BYTES_PER_S = _key(TRACE, "peak_dram_bytes_per_s", "float", "its DRAM bytes/s roof")
PEAK_SOURCE = _key(TRACE, "peak_source", "str", "cpu-microbenchmark, gpu-spec, ...")
PEAK_MEASURED = _key(TRACE, "peak_measured", "bool", "the GPU roofs were measured")
PEAK_MEASURED_NS = _key(TRACE, "peak_measured_ns", "int", "epoch ns the CPU peak was measured")
PEAK_ROUNDS = _key(TRACE, "peak_rounds", "int", "rounds of the CPU microbenchmark")
PEAK_LOAD_PER_CPU = _key(TRACE, "peak_load_per_cpu", "float", "load per CPU while measuring")
PEAK_CACHE_BYTES_PER_S = _key(TRACE, "peak_cache_bytes_per_s", "object", "per cache level")
PEAK_CACHE_SOURCE = _key(TRACE, "peak_cache_source", "str", "where the cache roofs came from")
CACHE_SIZES_BYTES = _key(TRACE, "cache_sizes_bytes", "object", "per cache level")
GRAPH_OPTIMIZATIONS = _key(TRACE, "graph_optimizations", "str", "`enabled` / `disabled`")
GRAPH_OPTIMIZATION_LEVEL = _key(TRACE, "graph_optimization_level", "str", "ORT's level")
LAYER_NAMES = _key(TRACE, "layer_names", "str", "`original` / `optimized`")
ORIGINAL_NODES_ATTRIBUTED = _key(TRACE, "original_nodes_attributed", "int", "nodes placed")
ORIGINAL_NODES_TOTAL = _key(TRACE, "original_nodes_total", "int", "nodes of the graph")
LEVELS = _key(TRACE, "levels", "list", "levels captured")
KERNEL_LEVEL = _key(TRACE, "kernel_level", "str", "`captured` or why not")
KERNEL_METRICS_SOURCE = _key(TRACE, "kernel_metrics_source", "str", "where counters came from")
KERNEL_METRICS_ESTIMATED = _key(TRACE, "kernel_metrics_estimated", "bool", "counters estimated")
LAYER_TIME_BASE = _key(TRACE, "layer_time_base", "str", "the clock layers were timed on")
MODEL_RUNS = _key(TRACE, "model_runs", "int", "M runs pooled into the model statistics")
TRIM_PROPORTION = _key(TRACE, "trim_proportion", "float", "trimmed-mean cut (XSP: 0.2)")
REPRESENTATIVE_ITERATION = _key(TRACE, "representative_iteration", "int", "timeline iteration")
TIMELINE_RUN = _key(TRACE, "timeline_run", "str", "the run whose timeline is kept")
ITERATIONS_DISCARDED = _key(TRACE, "iterations_discarded", "int", "iterations dropped")
INTERRUPTED_ITERATIONS_KEPT = _key(TRACE, "interrupted_iterations_kept", "int", "kept anyway")
EXPERIMENT_WALL_S = _key(TRACE, "experiment_wall_s", "float", "the profile's wall time")
CLOCK_CHECK = _key(TRACE, "clock_check", "str", "CUPTI records vs the host clock: `ok (...)`")
CUPTI_RECORDS = _key(TRACE, "cupti_records", "int", "CUPTI activity records")
CUPTI_API_RECORDS = _key(TRACE, "cupti_api_records", "int", "CUPTI API records")
DECOUPLED = _key(TRACE, "decoupled", "bool", "Python model: a decoupled model (a stream)")
DECOUPLED_RESPONSES = _key(TRACE, "decoupled_responses", "int", "its most responses to one call")
DECOUPLED_TIME_TO_FIRST_RESPONSE_NS = _key(
    TRACE, "decoupled_time_to_first_response_ns", "int", "its first response (M, trimmed mean)"
)
DECOUPLED_RESPONSE_GAP_NS = _key(
    TRACE, "decoupled_response_gap_ns", "int", "between its responses (M, trimmed mean)"
)
CALLS_NOT_RECORDED = _key(TRACE, "calls_not_recorded", "int", "Python model: calls not recorded")
PYTHON_BACKEND = _key(TRACE, "python_backend", "str", "Python model: how it was run")
PYTHON_KERNEL_METHOD = _key(TRACE, "python_kernel_method", "str", "Python model: how K was taken")
PYTHON_KERNEL_SESSIONS = _key(
    TRACE, "python_kernel_sessions", "int", "Python model: ONNX Runtime sessions profiled in K"
)
PYTHON_KERNEL_SESSIONS_FAILED = _key(
    TRACE, "python_kernel_sessions_failed", "list", "Python model: sessions K could not profile"
)
PYTHON_KERNEL_TORCH = _key(TRACE, "python_kernel_torch", "bool", "Python model: torch ops in K")
RECORDING = _key(TRACE, "recording", "str", "the GPU recording runner's mode")
RECORDING_WHAT = _key(TRACE, "recording_what", "str", "what it recorded")
MODEL_LATENCY_NOTE = _key(TRACE, "model_latency_note", "str", "how model latency was taken")
TORCHSCRIPT_OPTIMIZED_EXECUTION = _key(
    TRACE, "torchscript_optimized_execution", "bool", "TorchScript's optimized execution"
)
TRANSFORMER_FASTPATH = _key(TRACE, "transformer_fastpath", "bool", "PyTorch's fast path")
TF_PROFILER_CLOCK = _key(TRACE, "tf_profiler_clock", "str", "TF: the profiler's clock")
TF_SCOPE_UNIQUIFIER_REMOVED = _key(TRACE, "tf_scope_uniquifier_removed", "bool", "TF: `_1` cut")
ENSEMBLE = _key(TRACE, "ensemble", "str", "the ensemble replayed")
ENSEMBLE_REPLAY = _key(TRACE, "ensemble_replay", "str", "how its steps were replayed")
ENSEMBLE_STEPS = _key(TRACE, "ensemble_steps", "list", "its steps")
ENSEMBLE_FAILED_STEP = _key(TRACE, "ensemble_failed_step", "object", "the failed step; why")
PARTIAL_REPLAY = _key(TRACE, "partial_replay", "str", "why the replay covers part of the model")
SYNTHETIC = _key(TRACE, "synthetic", "bool", "made by the test harness, not measured")
ASSEMBLY = _key(TRACE, "assembly", "object", "a sampled trace's parts: whole, or what is missing")
# its keys (`trace.parts`)
ASSEMBLY_STATE = _key(ASSEMBLY, "state", "str", "`whole` or `incomplete`")
ASSEMBLY_MISSING = _key(ASSEMBLY, "missing", "list", "the parts that never came")
ASSEMBLY_WHY = _key(ASSEMBLY, "why", "object", "per missing part, why it never will come")
FIDELITY = _key(TRACE, "fidelity", "object", "the server's compute time vs the replay's")
# its keys (`trace.fidelity`; `server_batch_window` is copied from the request span)
LIVE_COMPUTE_NS = _key(FIDELITY, "live_compute_ns", "int", "the backend's compute time")
LIVE_SOURCE = _key(FIDELITY, "live_source", "str", "`compute_infer` or `tf_ops`")
LIVE_SOURCE_TF_OPS = "tf_ops"  # live_source: the envelope of the request's `tf_op` spans
REPLAY_MODEL_NS = _key(FIDELITY, "replay_model_ns", "int", "the replay's model latency (M)")
RATIO = _key(FIDELITY, "ratio", "float", "replay_model_ns / live_compute_ns")
# `server_config`'s keys the fidelity analysis reads
PLATFORM = _key(SERVER_CONFIG, "platform", "str", "config.platform")
INSTANCE_KIND = _key(SERVER_CONFIG, "instance_kind", "str", "the first instance group's kind")
INSTANCE_COUNT = _key(SERVER_CONFIG, "instance_count", "int", "instances over all groups")
GPUS = _key(SERVER_CONFIG, "gpus", "list", "the GPUs the instance groups name")
ACCELERATORS = _key(SERVER_CONFIG, "accelerators", "list", "execution accelerators' names")
MAX_BATCH_SIZE = _key(SERVER_CONFIG, "max_batch_size", "int", "as configured (0: no batching)")
DYNAMIC_BATCHING = _key(SERVER_CONFIG, "dynamic_batching", "bool", "a dynamic_batching block")
PREFERRED_BATCH_SIZES = _key(SERVER_CONFIG, "preferred_batch_sizes", "list", "as written")
# `replay_settings` records' keys
SETTING = _key(REPLAY_SETTINGS, "setting", "str", "where the setting is in the config")
SETTING_VALUE = _key(REPLAY_SETTINGS, "value", "str", "its value as text")
APPLIED = _key(REPLAY_SETTINGS, "applied", "bool", "the replay ran with it")
REASON = _key(REPLAY_SETTINGS, "reason", "str", "why not, or a note")


def _level_row(level: Level) -> str:
    xsp = next((code for code, lv in LEVEL_CODES.items() if lv is level), "-")
    source = (
        f"`{Source.REPLAY}`"
        if level in REPLAY_LEVELS
        else f"`{Source.PROXY if level is Level.REQUEST else Source.BACKEND}` (live)"
    )
    meaning = LEVEL_MEANINGS[level]
    if level is Level.KERNEL:
        meaning += "; `kind` = " + ", ".join(f"`{k}`" for k in KernelKind)
    return f"| `{level}` | {xsp} | {source} | {meaning} |"


def markdown() -> str:
    """The version, levels and attributes of `docs/trace-schema.md` (its generated part)."""
    lines = [
        f"Schema version: **{SCHEMA_VERSION}**.",
        "",
        "| level | XSP | source | what a span is |",
        "|---|---|---|---|",
        *(_level_row(level) for level in Level),
        "",
        "Every attribute key (`on`: the level(s) of the spans that carry it, `trace` for the "
        "trace's own attributes, or the attribute whose object holds it):",
        "",
        "| key | on | type | meaning |",
        "|---|---|---|---|",
    ]
    for a in ATTRIBUTES.values():
        lines.append(f"| `{a.name}` | {a.on} | {a.type} | {a.meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m sidecar.trace.schema --markdown")
    sys.stdout.write(markdown())
