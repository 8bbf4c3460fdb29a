"""Rebuild the seed corpora under tests/fuzz/corpus/ from real gRPC exchanges.

A plain grpcio server stands in for the model server (KServe v2 `ModelInfer` and
`ModelStreamInfer` as Triton serves them, TF-Serving's `Predict`), a real grpcio client calls
it through the relay (the test harness's `RelayThread`, with the Python `data_received` so the
bytes of every read can be recorded as they arrive, each way), and each connection's reads
become seed inputs for every target: the reads as pump steps, one direction's bytes for the
frame walk, the DATA payloads of each stream for the message walk, a request's first bytes for
the model name, the header blocks for HPACK.

    python -m tests.fuzz.corpus_build   # rewrites tests/fuzz/corpus/*/seed-*
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from sidecar.endpoint import Endpoint
from sidecar.proxy import relay
from sidecar.proxy.frames import CONTINUATION, DATA, FLAG_PADDED, FLAG_PRIORITY, HEADERS, PREFACE
from sidecar.proxy.model_name import HEAD_LIMIT
from tests.fuzz.common import CORPUS, Writer
from tests.proxy.proxy_harness import TRITON_SERVICE, RelayThread
from tests.proxy.test_proxy_model_name import tf_predict_request

TF_SERVICE = "tensorflow.serving.PredictionService"
Reads = list[tuple[bool, bytes]]


def infer_request(model: str, ident: str, size: int) -> bytes:
    req = service_pb2.ModelInferRequest(model_name=model, id=ident)
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, size])
    req.raw_input_contents.append(bytes(4 * size))
    return req.SerializeToString()


def infer(req: bytes, ctx: grpc.ServicerContext) -> bytes:
    parsed = service_pb2.ModelInferRequest.FromString(req)
    if parsed.model_name == "missing":
        ctx.abort(grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'missing' is not found")
    resp = service_pb2.ModelInferResponse(model_name=parsed.model_name, id=parsed.id)
    resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 4])
    resp.raw_output_contents.append(bytes(16))
    return resp.SerializeToString()


def infer_stream(requests: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
    for req in requests:  # a response per request, then Triton's empty final one
        parsed = service_pb2.ModelInferRequest.FromString(req)
        for final in (False, True):
            reply = service_pb2.ModelStreamInferResponse()
            reply.infer_response.model_name = parsed.model_name
            reply.infer_response.id = parsed.id
            reply.infer_response.parameters["triton_final_response"].bool_param = final
            if not final:
                reply.infer_response.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1])
                reply.infer_response.raw_output_contents.append(bytes(4))
            yield reply.SerializeToString()


def predict(req: bytes, ctx: grpc.ServicerContext) -> bytes:
    return b"\x0a\x0d\x0a\x01y\x12\x08\x08\x01\x12\x00\x2a\x01\x00" + req[:40]


def serve() -> tuple[grpc.Server, int]:
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                TRITON_SERVICE,
                {
                    "ModelInfer": grpc.unary_unary_rpc_method_handler(infer),
                    "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(infer_stream),
                },
            ),
            grpc.method_handlers_generic_handler(
                TF_SERVICE, {"Predict": grpc.unary_unary_rpc_method_handler(predict)}
            ),
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def exchanges(address: str) -> Iterator[tuple[str, Any]]:
    """Each a name and a function of a channel: one connection's calls."""

    def kserve(channel: grpc.Channel) -> None:
        call = channel.unary_unary(f"/{TRITON_SERVICE}/ModelInfer")
        for i, size in enumerate([4, 4, 300]):
            call(infer_request("add_sub", str(i), size))
        with contextlib.suppress(grpc.RpcError):  # a trailers-only NOT_FOUND
            call(infer_request("missing", "9", 1))

    def tfserving(channel: grpc.Channel) -> None:
        call = channel.unary_unary(f"/{TF_SERVICE}/Predict")
        for name in ["resnet", "resnet", "résnet"]:
            call(tf_predict_request(name))

    def stream(channel: grpc.Channel) -> None:
        call = channel.stream_stream(f"/{TRITON_SERVICE}/ModelStreamInfer")
        msgs = [infer_request(f"m{i % 2}", str(i), 2) for i in range(4)]
        for _ in call(iter(msgs)):
            pass

    yield from [("kserve", kserve), ("tfserving", tfserving), ("stream", stream)]


def capture() -> dict[str, Reads]:
    """Each exchange's reads through the relay, in the order they arrived."""
    reads: Reads = []
    lock = threading.Lock()
    saved = relay.native_pump, relay._ClientProtocol.data_received
    saved_backend = relay._BackendProtocol.data_received

    def recording(inner: Any, client: bool) -> Any:
        def data_received(self: Any, data: bytes) -> None:
            with lock:
                reads.append((client, bytes(data)))
            inner(self, data)

        return data_received

    relay.native_pump = None
    relay._ClientProtocol.data_received = recording(saved[1], True)  # type: ignore[method-assign]
    relay._BackendProtocol.data_received = recording(saved_backend, False)  # type: ignore[method-assign]
    server, port = serve()
    side = RelayThread(Endpoint("127.0.0.1", port))
    out: dict[str, Reads] = {}
    try:
        for name, calls in exchanges(side.address):
            with grpc.insecure_channel(side.address) as channel:
                calls(channel)
            with lock:
                out[name] = list(reads)
                reads.clear()
    finally:
        side.close()
        server.stop(0)
        relay.native_pump, relay._ClientProtocol.data_received = saved  # type: ignore[method-assign]
        relay._BackendProtocol.data_received = saved_backend  # type: ignore[method-assign]
    return out


def frames_of(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of each whole frame of one direction."""
    pos = len(PREFACE) if data.startswith(PREFACE) else 0
    while pos + 9 <= len(data):
        size = int.from_bytes(data[pos : pos + 3], "big")
        ftype, flags = data[pos + 3], data[pos + 4]
        sid = int.from_bytes(data[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        yield ftype, flags, sid, data[pos + 9 : pos + 9 + size]
        pos += 9 + size


def unpadded(ftype: int, flags: int, payload: bytes) -> bytes:
    if flags & FLAG_PADDED:
        payload = payload[1 : len(payload) - payload[0]]
    if ftype == HEADERS and flags & FLAG_PRIORITY:
        payload = payload[5:]
    return payload


def seeds(reads: Reads) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {t: [] for t in TARGETS}
    client = b"".join(d for c, d in reads if c)
    server = b"".join(d for c, d in reads if not c)
    # the pump: every read as a step, whole, then cut in two, sampling off and on
    for options in (0, 1, 2, 2 | 4, 1 | 8):
        w = Writer().uint(1, options)
        for i, (side, data) in enumerate(reads):
            w.uint(1, int(side)).uint(2, len(data)).cuts([len(data) // 2] if i % 2 else [])
            w.raw(data)
        out["pump"].append(w.bytes())
    # the frame walk: the server's bytes observed and held, the client's through a tracker
    cuts = [len(server) // 3, 2 * len(server) // 3]
    out["framewalk"] += [
        Writer().uint(1, 0).cuts(cuts).raw(server).bytes(),
        Writer().uint(1, 1 | 4).cuts([]).raw(server).bytes(),
        Writer().uint(1, 2).cuts([len(client) // 2]).raw(client).bytes(),
    ]
    # per stream: DATA payloads (the message walk, the model name) and header blocks (HPACK)
    hpack = Writer().uint(1, 1)
    for side, data in ((True, client), (False, server)):
        payloads: dict[int, bytearray] = {}
        block = bytearray()
        for ftype, flags, sid, payload in frames_of(data):
            if ftype == DATA:
                payloads.setdefault(sid, bytearray()).extend(unpadded(ftype, flags, payload))
            elif ftype in (HEADERS, CONTINUATION):
                if ftype == HEADERS:
                    block = bytearray()
                    end_stream = flags & 1
                block += unpadded(ftype, flags, payload)
                if flags & 4:  # END_HEADERS
                    hpack.uint(1, int(not side) | (2 if end_stream else 0)).uint(1, sid & 0xFF)
                    hpack.uint(2, len(block)).raw(bytes(block))
        for wire in list(payloads.values())[:2]:
            options = 0 if side else 1
            out["messagewalk"].append(
                Writer().uint(1, options | 2).uint(2, 64).uint(1, 0b1001_0110).cuts([7, 30])
                .raw(bytes(wire)).bytes()
            )  # fmt: skip
            if side:
                tf = b"resnet" in wire or "résnet".encode() in wire  # TF-Serving: (1, 1)
                head = bytes(wire[:HEAD_LIMIT])
                out["model_name"].append(Writer().uint(1, int(tf)).raw(head).bytes())
    out["hpack"].append(hpack.bytes())
    return out


TARGETS = ["framewalk", "pump", "messagewalk", "model_name", "hpack"]


def main() -> None:
    captured = capture()
    for target in TARGETS:
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("seed-*"):
            old.unlink()
    for name, reads in captured.items():
        for target, inputs in seeds(reads).items():
            for data in inputs:
                digest = hashlib.sha1(data).hexdigest()[:12]
                (CORPUS / target / f"seed-{name}-{digest}").write_bytes(data)
    for target in TARGETS:
        files = list((CORPUS / target).iterdir())
        print(target, len(files), "inputs", sum(f.stat().st_size for f in files), "bytes")


if __name__ == "__main__":
    main()
