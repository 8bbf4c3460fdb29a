"""The backends' HTTP routes (`Backend.http_route`): every route of Triton's KServe v2 HTTP API
and TF-Serving's REST API gets the gRPC method label of the same call and its model name,
percent-decoded; versions and labels, query strings and absolute-form targets are read as the
servers read them; anything else, or a route asked with the wrong verb, is `_unknown`."""

from __future__ import annotations

import pytest

from sidecar.backends import TF_SERVING, TRITON
from sidecar.backends.base import (
    UNKNOWN_METHOD,
    Backend,
    DecodedInputs,
    HttpCall,
    HttpRoute,
    Readiness,
    Repository,
    SpanSource,
)

UNKNOWN = HttpCall(UNKNOWN_METHOD, None)


@pytest.mark.parametrize(
    ("verb", "target", "call"),
    [
        ("POST", "/v2/models/resnet/infer", HttpCall("ModelInfer", "resnet")),
        ("POST", "/v2/models/resnet/versions/3/infer", HttpCall("ModelInfer", "resnet")),
        ("GET", "/v2/models/resnet", HttpCall("ModelMetadata", "resnet")),
        ("GET", "/v2/models/resnet/versions/12", HttpCall("ModelMetadata", "resnet")),
        ("GET", "/v2/models/resnet/ready", HttpCall("ModelReady", "resnet")),
        ("GET", "/v2/models/resnet/versions/1/ready", HttpCall("ModelReady", "resnet")),
        ("GET", "/v2/models/resnet/config", HttpCall("ModelConfig", "resnet")),
        ("GET", "/v2/models/resnet/versions/1/config", HttpCall("ModelConfig", "resnet")),
        ("GET", "/v2/models/stats", HttpCall("ModelStatistics", None)),
        ("GET", "/v2/models/resnet/stats", HttpCall("ModelStatistics", "resnet")),
        ("GET", "/v2/models/resnet/versions/2/stats", HttpCall("ModelStatistics", "resnet")),
        ("POST", "/v2/models/llm/generate", HttpCall("ModelGenerate", "llm")),
        ("POST", "/v2/models/llm/generate_stream", HttpCall("ModelGenerateStream", "llm")),
        ("GET", "/v2/health/live", HttpCall("ServerLive", None)),
        ("GET", "/v2/health/ready", HttpCall("ServerReady", None)),
        ("GET", "/v2", HttpCall("ServerMetadata", None)),
        ("POST", "/v2/repository/index", HttpCall("RepositoryIndex", None)),
        ("POST", "/v2/repository/models/resnet/load", HttpCall("RepositoryModelLoad", "resnet")),
        ("POST", "/v2/repository/models/resnet/unload",
         HttpCall("RepositoryModelUnload", "resnet")),
        ("GET", "/v2/trace/setting", HttpCall("TraceSetting", None)),
        ("POST", "/v2/models/resnet/trace/setting", HttpCall("TraceSetting", "resnet")),
        ("GET", "/v2/logging", HttpCall("LogSettings", None)),
        ("GET", "/v2/systemsharedmemory/status", HttpCall("SystemSharedMemoryStatus", None)),
        ("GET", "/v2/systemsharedmemory/region/r0/status",
         HttpCall("SystemSharedMemoryStatus", None)),
        ("POST", "/v2/systemsharedmemory/region/r0/register",
         HttpCall("SystemSharedMemoryRegister", None)),
        ("POST", "/v2/systemsharedmemory/unregister",
         HttpCall("SystemSharedMemoryUnregister", None)),
        ("GET", "/v2/cudasharedmemory/status", HttpCall("CudaSharedMemoryStatus", None)),
        ("POST", "/v2/cudasharedmemory/region/g/register",
         HttpCall("CudaSharedMemoryRegister", None)),
        ("POST", "/v2/cudasharedmemory/region/g/unregister",
         HttpCall("CudaSharedMemoryUnregister", None)),
    ],
)  # fmt: skip
def test_every_triton_route(verb: str, target: str, call: HttpCall) -> None:
    assert TRITON.http_route(verb.encode(), target.encode()) == call


@pytest.mark.parametrize(
    ("verb", "target", "call"),
    [
        ("POST", "/v1/models/half:predict", HttpCall("Predict", "half")),
        ("POST", "/v1/models/half/versions/2:predict", HttpCall("Predict", "half")),
        ("POST", "/v1/models/half/labels/canary:predict", HttpCall("Predict", "half")),
        ("POST", "/v1/models/half:classify", HttpCall("Classify", "half")),
        ("POST", "/v1/models/half/versions/7:regress", HttpCall("Regress", "half")),
        ("GET", "/v1/models/half", HttpCall("GetModelStatus", "half")),
        ("GET", "/v1/models/half/versions/2", HttpCall("GetModelStatus", "half")),
        ("GET", "/v1/models/half/labels/stable", HttpCall("GetModelStatus", "half")),
        ("GET", "/v1/models/half/metadata", HttpCall("GetModelMetadata", "half")),
        ("GET", "/v1/models/half/versions/2/metadata", HttpCall("GetModelMetadata", "half")),
        # TF-Serving's expressions ignore case, but its handler compares the verb as written
        # (`:PREDICT` is answered "Malformed request")
        ("POST", "/V1/Models/half:predict", HttpCall("Predict", "half")),
        ("POST", "/v1/models/half:PREDICT", HttpCall("_unknown", None)),
    ],
)
def test_every_tf_serving_route(verb: str, target: str, call: HttpCall) -> None:
    assert TF_SERVING.http_route(verb.encode(), target.encode()) == call


def test_model_names_are_percent_decoded() -> None:
    assert TRITON.http_route(b"POST", b"/v2/models/my%20model%2Fv/infer") == HttpCall(
        "ModelInfer", "my model/v"
    )
    assert TF_SERVING.http_route(b"POST", b"/v1/models/caf%C3%A9:predict") == HttpCall(
        "Predict", "café"
    )
    # not UTF-8: replaced, never raised
    assert TRITON.http_route(b"GET", b"/v2/models/%FF") == HttpCall("ModelMetadata", "\ufffd")


def test_the_query_string_is_no_part_of_the_route() -> None:
    assert TRITON.http_route(b"POST", b"/v2/models/m/infer?x=1&y=/a") == HttpCall("ModelInfer", "m")
    assert TF_SERVING.http_route(b"GET", b"/v1/models/m?x") == HttpCall("GetModelStatus", "m")
    assert TRITON.http_route(b"GET", b"/v2?") == HttpCall("ServerMetadata", None)


def test_an_absolute_form_target_is_routed_by_its_path() -> None:
    assert TRITON.http_route(b"POST", b"http://triton:8000/v2/models/m/infer") == HttpCall(
        "ModelInfer", "m"
    )
    assert TRITON.http_route(b"GET", b"*") == UNKNOWN


@pytest.mark.parametrize(
    ("backend", "verb", "target"),
    [
        (TRITON, "GET", "/v2/models/m/infer"),  # wrong verb
        (TRITON, "POST", "/v2/models/m"),
        (TRITON, "DELETE", "/v2/models/m"),
        (TRITON, "POST", "/v2/models/m/versions/latest/infer"),  # versions are numbers
        (TRITON, "POST", "/v2/models//infer"),
        (TRITON, "POST", "/v2/models/m/infer/"),
        (TRITON, "GET", "/v1/models/m"),
        (TRITON, "GET", "/"),
        (TRITON, "GET", ""),
        (TF_SERVING, "GET", "/v1/models/m:predict"),  # wrong verb
        (TF_SERVING, "POST", "/v1/models/m"),
        (TF_SERVING, "POST", "/v1/models/m:explain"),
        (TF_SERVING, "POST", "/v1/models/m/versions/x:predict"),
        (TF_SERVING, "POST", "/v2/models/m/infer"),
    ],
)
def test_anything_else_is_unknown(backend: Backend, verb: str, target: str) -> None:
    assert backend.http_route(verb.encode(), target.encode()) == UNKNOWN


def test_answers_are_cached_per_path_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.backends import base

    backend = _backend(http_routes=(HttpRoute("GET", r"/m/(?P<model>[^/]+)", "Get"),))
    monkeypatch.setattr(base, "_HTTP_CACHE_SIZE", 2)
    first = backend.http_route(b"GET", b"/m/a?q=1")
    assert backend.http_route(b"GET", b"/m/a?q=2") is first  # the query is not in the key
    for name in (b"b", b"c", b"d"):
        assert backend.http_route(b"GET", b"/m/" + name) == HttpCall("Get", name.decode())
    assert len(backend._http_table._cache) == 2


def test_a_backend_without_routes_routes_nothing() -> None:
    assert _backend().http_route(b"GET", b"/v2") == UNKNOWN


def _decode(message: bytes) -> DecodedInputs:
    return DecodedInputs({})


def _backend(**fields: object) -> Backend:
    return Backend(
        name="toy",
        methods={"/toy.S/Get": (1,)},
        replayable={},
        decoders={"Job": _decode},
        repository=Repository("flat", lambda root, model: False, lambda r, m, v: None),  # type: ignore[arg-type,return-value]
        readiness=Readiness(),
        spans=SpanSource.OTLP,
        **fields,  # type: ignore[arg-type]
    )


def test_a_replayable_http_method_must_be_routed_and_its_job_method_decoded() -> None:
    route = (HttpRoute("POST", r"/infer/(?P<model>[^/]+)", "Infer"),)
    _backend(http_routes=route, http_replayable={"Infer": "Job"})
    with pytest.raises(ValueError, match="HTTP-replayable but not routed"):
        _backend(http_routes=route, http_replayable={"Other": "Job"})
    with pytest.raises(ValueError, match="no decoder for \\['HttpJob'\\]"):
        _backend(http_routes=route, http_replayable={"Infer": "HttpJob"})


def test_a_route_is_a_valid_expression_with_no_group_but_model() -> None:
    with pytest.raises(ValueError, match="route"):
        _backend(http_routes=(HttpRoute("GET", r"/m/(", "Get"),))
    with pytest.raises(ValueError, match="the only named group is `model`"):
        _backend(http_routes=(HttpRoute("GET", r"/m/(?P<version>[0-9]+)", "Get"),))


def test_the_shipped_backends_replay_their_http_inference() -> None:
    assert TRITON.http_replayable == {"ModelInfer": "HttpModelInfer"}
    assert TF_SERVING.http_replayable == {"Predict": "HttpPredict"}
    assert "HttpModelInfer" in TRITON.decoders
    assert "HttpPredict" in TF_SERVING.decoders
    # one label covers both protocols: every HTTP label of a gRPC call is that call's name
    for backend in (TRITON, TF_SERVING):
        grpc = {path.rsplit("/", 1)[-1] for path in backend.methods}
        http = {route.method for route in backend.http_routes}
        assert http - grpc <= {"ModelGenerate", "ModelGenerateStream"}
