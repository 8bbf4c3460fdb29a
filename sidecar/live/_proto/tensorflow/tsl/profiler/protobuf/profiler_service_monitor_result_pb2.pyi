from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfilerServiceMonitorResult(_message.Message):
    __slots__ = ("response_type", "device_idle_time_percent", "matrix_unit_utilization_percent", "step_time_ms_avg", "step_time_ms_min", "step_time_ms_max", "infeed_percent_avg", "infeed_percent_min", "infeed_percent_max")
    class ResponseType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        EMPTY_RESULT: _ClassVar[ProfilerServiceMonitorResult.ResponseType]
        UTIL_ONLY: _ClassVar[ProfilerServiceMonitorResult.ResponseType]
        UTIL_IDLE: _ClassVar[ProfilerServiceMonitorResult.ResponseType]
        UTIL_IDLE_STEP: _ClassVar[ProfilerServiceMonitorResult.ResponseType]
    EMPTY_RESULT: ProfilerServiceMonitorResult.ResponseType
    UTIL_ONLY: ProfilerServiceMonitorResult.ResponseType
    UTIL_IDLE: ProfilerServiceMonitorResult.ResponseType
    UTIL_IDLE_STEP: ProfilerServiceMonitorResult.ResponseType
    RESPONSE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDLE_TIME_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MATRIX_UNIT_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_AVG_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_MIN_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_MAX_FIELD_NUMBER: _ClassVar[int]
    INFEED_PERCENT_AVG_FIELD_NUMBER: _ClassVar[int]
    INFEED_PERCENT_MIN_FIELD_NUMBER: _ClassVar[int]
    INFEED_PERCENT_MAX_FIELD_NUMBER: _ClassVar[int]
    response_type: ProfilerServiceMonitorResult.ResponseType
    device_idle_time_percent: float
    matrix_unit_utilization_percent: float
    step_time_ms_avg: float
    step_time_ms_min: float
    step_time_ms_max: float
    infeed_percent_avg: float
    infeed_percent_min: float
    infeed_percent_max: float
    def __init__(self, response_type: _Optional[_Union[ProfilerServiceMonitorResult.ResponseType, str]] = ..., device_idle_time_percent: _Optional[float] = ..., matrix_unit_utilization_percent: _Optional[float] = ..., step_time_ms_avg: _Optional[float] = ..., step_time_ms_min: _Optional[float] = ..., step_time_ms_max: _Optional[float] = ..., infeed_percent_avg: _Optional[float] = ..., infeed_percent_min: _Optional[float] = ..., infeed_percent_max: _Optional[float] = ...) -> None: ...
