from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileOptions(_message.Message):
    __slots__ = ("version", "device_type", "include_dataset_ops", "host_tracer_level", "device_tracer_level", "python_tracer_level", "enable_hlo_proto", "start_timestamp_ns", "duration_ms", "repository_path", "trace_options")
    class DeviceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[ProfileOptions.DeviceType]
        CPU: _ClassVar[ProfileOptions.DeviceType]
        GPU: _ClassVar[ProfileOptions.DeviceType]
        TPU: _ClassVar[ProfileOptions.DeviceType]
        PLUGGABLE_DEVICE: _ClassVar[ProfileOptions.DeviceType]
    UNSPECIFIED: ProfileOptions.DeviceType
    CPU: ProfileOptions.DeviceType
    GPU: ProfileOptions.DeviceType
    TPU: ProfileOptions.DeviceType
    PLUGGABLE_DEVICE: ProfileOptions.DeviceType
    class TraceOptions(_message.Message):
        __slots__ = ("host_traceme_filter_mask",)
        HOST_TRACEME_FILTER_MASK_FIELD_NUMBER: _ClassVar[int]
        host_traceme_filter_mask: int
        def __init__(self, host_traceme_filter_mask: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DATASET_OPS_FIELD_NUMBER: _ClassVar[int]
    HOST_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    PYTHON_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    ENABLE_HLO_PROTO_FIELD_NUMBER: _ClassVar[int]
    START_TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_PATH_FIELD_NUMBER: _ClassVar[int]
    TRACE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    device_type: ProfileOptions.DeviceType
    include_dataset_ops: bool
    host_tracer_level: int
    device_tracer_level: int
    python_tracer_level: int
    enable_hlo_proto: bool
    start_timestamp_ns: int
    duration_ms: int
    repository_path: str
    trace_options: ProfileOptions.TraceOptions
    def __init__(self, version: _Optional[int] = ..., device_type: _Optional[_Union[ProfileOptions.DeviceType, str]] = ..., include_dataset_ops: bool = ..., host_tracer_level: _Optional[int] = ..., device_tracer_level: _Optional[int] = ..., python_tracer_level: _Optional[int] = ..., enable_hlo_proto: bool = ..., start_timestamp_ns: _Optional[int] = ..., duration_ms: _Optional[int] = ..., repository_path: _Optional[str] = ..., trace_options: _Optional[_Union[ProfileOptions.TraceOptions, _Mapping]] = ...) -> None: ...

class RemoteProfilerSessionManagerOptions(_message.Message):
    __slots__ = ("profiler_options", "service_addresses", "session_creation_timestamp_ns", "max_session_duration_ms", "delay_ms")
    PROFILER_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SESSION_CREATION_TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    profiler_options: ProfileOptions
    service_addresses: _containers.RepeatedScalarFieldContainer[str]
    session_creation_timestamp_ns: int
    max_session_duration_ms: int
    delay_ms: int
    def __init__(self, profiler_options: _Optional[_Union[ProfileOptions, _Mapping]] = ..., service_addresses: _Optional[_Iterable[str]] = ..., session_creation_timestamp_ns: _Optional[int] = ..., max_session_duration_ms: _Optional[int] = ..., delay_ms: _Optional[int] = ...) -> None: ...
