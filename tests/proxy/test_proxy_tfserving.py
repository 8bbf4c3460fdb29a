"""TF-Serving traffic through the relay, against a fake backend.

The backend here is a plain grpcio server that implements TF-Serving's
`PredictionService/Predict` and `ModelService/GetModelStatus` on raw protobuf bytes (a fake,
named as such), so this stays a fast test of the relay alone. The relay never parses past the
model name, so what is checked is exactly what it does with TF-Serving: bytes unchanged both
ways, errors unchanged, calls counted per method and model. The same relay in front of real
TensorFlow (the stand-in for `tensorflow_model_server`) is tested in
`tests/e2e/test_tfserving_relay.py`.
"""

from __future__ import annotations

import grpc
import pytest

from tests.harness.metrics_text import sample_value, scrape
from tests.proxy.proxy_harness import SidecarThread

PREDICT = "/tensorflow.serving.PredictionService/Predict"
STATUS = "/tensorflow.serving.ModelService/GetModelStatus"


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (payloads here are < 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


def model_spec(name: str, signature: str = "serving_default") -> bytes:
    """`ModelSpec{name=1, signature_name=3}`."""
    return _field(1, name.encode()) + _field(3, signature.encode())


def predict_request(model: str) -> bytes:
    """`PredictRequest{model_spec=1, inputs=2 (map entry with a float TensorProto)}`."""
    tensor = b"\x08\x01" + _field(2, _field(2, b"\x08\x03")) + b"\x2d\x00\x00\x80\x3f"
    return _field(1, model_spec(model)) + _field(2, _field(1, b"x") + _field(2, tensor))


def fake_tfserving() -> tuple[grpc.Server, int]:
    """A fake TF-Serving: answers Predict with the request's bytes reversed."""
    from concurrent import futures

    def predict(request: bytes, context: grpc.ServicerContext) -> bytes:
        if b"missing" in request:
            context.abort(grpc.StatusCode.NOT_FOUND, "Servable not found for request: missing")
        return request[::-1]

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(
            "tensorflow.serving.PredictionService",
            {"Predict": grpc.unary_unary_rpc_method_handler(predict)},
        ),
        grpc.method_handlers_generic_handler(
            "tensorflow.serving.ModelService",
            {"GetModelStatus": grpc.unary_unary_rpc_method_handler(lambda r, c: b"\x0a\x00")},
        ),
    ])  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_predict_and_model_status_pass_through_and_are_counted_per_model() -> None:
    server, port = fake_tfserving()
    side = SidecarThread(f"127.0.0.1:{port}", backend_protocol="tfserving")
    try:
        with grpc.insecure_channel(side.address) as channel:
            predict = channel.unary_unary(PREDICT, None, None)
            request = predict_request("resnet")
            for _ in range(2):
                assert predict(request) == request[::-1]
            with pytest.raises(grpc.RpcError) as info:
                predict(predict_request("missing"))
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
            assert info.value.details() == "Servable not found for request: missing"
            status = channel.unary_unary(STATUS, None, None)
            assert status(_field(1, model_spec("resnet"))) == b"\x0a\x00"
        text = scrape(side.metrics_url)
        requests = "xsp_requests_total"
        assert sample_value(text, requests, grpc_code="OK", method="Predict", model="resnet") == 2
        nf = dict(grpc_code="NOT_FOUND", method="Predict", model="missing")
        assert sample_value(text, requests, **nf) == 1
        status_ok = dict(grpc_code="OK", method="GetModelStatus", model="resnet")
        assert sample_value(text, requests, **status_ok) == 1
    finally:
        side.close()
        server.stop(0)
