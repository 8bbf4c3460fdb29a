from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InputTensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw_contents")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw_contents: bytes
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw_contents: _Optional[bytes] = ...) -> None: ...

class TriggerProfileRequest(_message.Message):
    __slots__ = ("model", "version", "inputs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    inputs: _containers.RepeatedCompositeFieldContainer[InputTensor]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[InputTensor, _Mapping]]] = ...) -> None: ...

class TriggerProfileResponse(_message.Message):
    __slots__ = ("trace_id", "accepted", "input_source", "message")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    INPUT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    accepted: bool
    input_source: str
    message: str
    def __init__(self, trace_id: _Optional[str] = ..., accepted: bool = ..., input_source: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ListTracesRequest(_message.Message):
    __slots__ = ("model", "limit")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    model: str
    limit: int
    def __init__(self, model: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class TraceSummary(_message.Message):
    __slots__ = ("trace_id", "model", "model_version", "created_unix_ns", "sample_reason", "status", "error", "batch_size", "model_latency_ns", "runtime", "device")
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_LATENCY_NS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    trace_id: str
    model: str
    model_version: str
    created_unix_ns: int
    sample_reason: str
    status: str
    error: str
    batch_size: int
    model_latency_ns: int
    runtime: str
    device: str
    def __init__(self, trace_id: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., created_unix_ns: _Optional[int] = ..., sample_reason: _Optional[str] = ..., status: _Optional[str] = ..., error: _Optional[str] = ..., batch_size: _Optional[int] = ..., model_latency_ns: _Optional[int] = ..., runtime: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class ListTracesResponse(_message.Message):
    __slots__ = ("traces",)
    TRACES_FIELD_NUMBER: _ClassVar[int]
    traces: _containers.RepeatedCompositeFieldContainer[TraceSummary]
    def __init__(self, traces: _Optional[_Iterable[_Union[TraceSummary, _Mapping]]] = ...) -> None: ...

class GetSamplingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingSettings(_message.Message):
    __slots__ = ("rate", "model_rates", "budget_per_minute", "force_header", "duty_cycle", "enabled")
    class ModelRatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_RATES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    FORCE_HEADER_FIELD_NUMBER: _ClassVar[int]
    DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    rate: float
    model_rates: _containers.ScalarMap[str, float]
    budget_per_minute: float
    force_header: str
    duty_cycle: float
    enabled: bool
    def __init__(self, rate: _Optional[float] = ..., model_rates: _Optional[_Mapping[str, float]] = ..., budget_per_minute: _Optional[float] = ..., force_header: _Optional[str] = ..., duty_cycle: _Optional[float] = ..., enabled: bool = ...) -> None: ...

class UpdateSamplingRequest(_message.Message):
    __slots__ = ("rate", "model_rates", "budget_per_minute", "force_header", "duty_cycle", "enabled")
    class ModelRatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_RATES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    FORCE_HEADER_FIELD_NUMBER: _ClassVar[int]
    DUTY_CYCLE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    rate: float
    model_rates: _containers.ScalarMap[str, float]
    budget_per_minute: float
    force_header: str
    duty_cycle: float
    enabled: bool
    def __init__(self, rate: _Optional[float] = ..., model_rates: _Optional[_Mapping[str, float]] = ..., budget_per_minute: _Optional[float] = ..., force_header: _Optional[str] = ..., duty_cycle: _Optional[float] = ..., enabled: bool = ...) -> None: ...
