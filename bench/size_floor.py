"""The relay beside socat at realistic sizes, gRPC or HTTP: `proxy_overhead.py --sizes` runs it.

For each request size (and the same response size: `add_sub` with two FP32 inputs of size/8
elements each answers two outputs of the same size), each concurrency, four paths in front of
one real Triton, measured in `--rounds` alternating windows (direct, socat, relay with sampling
off, relay with sampling at its default settings, then again) so drift in the machine's load
falls on all of them:

- gRPC (`--protocol grpc`): unary `ModelInfer` over one channel per client process, the relay
  an `xsp-sidecar serve` (`--listen`), socat on Triton's gRPC port;
- HTTP (`--protocol http`): KServe v2 `POST /v2/models/add_sub/infer` with the binary-tensor
  extension (inputs and outputs as raw bytes after a JSON header), one keep-alive HTTP/1.1
  connection per client process, the relay the same `serve` with `--http-listen` and
  `--http-backend` (the HTTP plane), socat on Triton's HTTP port.

socat copies in blocks of `--socat-buffer` bytes (256000 by default, the size of uvloop's
receive buffer the relay reads into; socat's own default of 8192 makes it the slower copier
at 2 MB, no floor). It prints, per size and concurrency, throughput, p50 and CPU per call of
each, and side by side the ratios the relay-floor goals are stated in: relay CPU per call /
socat's, throughput / socat's, p50 added to direct (relay and socat), and what sampling on
adds per call.

`split_frame_cost` (gRPC, in-process, no sockets) measures what a DATA frame split across two
reads costs where the C walk hands the rest of the chunk to the Python scanner: the same
connection's bytes of large unary calls scanned in chunks that end on frame boundaries and in
fixed-size reads that cut frames, sampling off and on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

from proxy_overhead import (
    Result,
    await_listening,
    cpu_seconds,
    forking_relay_cpu_seconds,
    run_load,
    start_bare_relay,
)

from tests.harness.process import free_port

MODEL = "add_sub"
GOALS = "goals (issue 42/44): relay CPU <= 1.3x socat's, throughput >= 0.97 of socat's, sampling on <= +10 us/call"  # noqa: E501
PATHS = ("direct", "socat", "relay off", "relay on")


def parse_size(text: str) -> int:
    """`16`, `49152`, `48K`, `2M` (K and M are 1024-based) -> bytes, a multiple of 8 (two FP32
    inputs), at least 8."""
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    size = int(float(number) * scale)
    if size < 8:
        raise argparse.ArgumentTypeError(f"size {text!r}: at least 8 bytes (two FP32 inputs)")
    return size - size % 8


def elements(size: int) -> int:
    """FP32 elements of each of add_sub's two inputs (and outputs) for `size` bytes each way."""
    return max(1, size // 8)


def grpc_request(size: int) -> object:
    import numpy as np
    from tritonclient.grpc import service_pb2

    n = elements(size)
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[n])
        req.raw_input_contents.append(np.ones(n, dtype=np.float32).tobytes())
    return req


def http_request(size: int) -> tuple[bytes, dict[str, str]]:
    """KServe v2 binary-tensor request body and its headers: a JSON header, then both inputs'
    raw bytes; both outputs asked for as binary data."""
    n = elements(size)
    header = {
        "inputs": [
            {"name": name, "shape": [n], "datatype": "FP32",
             "parameters": {"binary_data_size": 4 * n}}
            for name in ("INPUT0", "INPUT1")
        ],
        "outputs": [
            {"name": name, "parameters": {"binary_data": True}} for name in ("OUTPUT0", "OUTPUT1")
        ],
    }  # fmt: skip
    head = json.dumps(header, separators=(",", ":")).encode()
    body = head + bytes(4 * n) * 2
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }
    return body, headers


def _grpc_client(
    address: str, duration: float, warmup: float, conn: Connection, model: str, size: int = 16
) -> None:
    """`proxy_overhead._client` with a request of `size` bytes (2 MB needs a larger limit)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    req = grpc_request(size)
    limit = [("grpc.max_receive_message_length", 64 << 20)]
    channel = grpc.insecure_channel(address, options=limit)
    infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
    _closed_loop(lambda: infer(req), duration, warmup, conn)
    channel.close()


def _http_client(
    address: str, duration: float, warmup: float, conn: Connection, model: str, size: int = 16
) -> None:
    """One keep-alive HTTP/1.1 connection (http.client), KServe v2 binary-tensor infer calls."""
    import http.client

    host, _, port = address.rpartition(":")
    body, headers = http_request(size)
    path = f"/v2/models/{model}/infer"
    client = http.client.HTTPConnection(host, int(port), timeout=60)

    def infer() -> None:
        client.request("POST", path, body, headers)
        response = client.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")

    _closed_loop(infer, duration, warmup, conn)
    client.close()


def _closed_loop(infer: object, duration: float, warmup: float, conn: Connection) -> None:
    """Warm up, wait for 'go', run for `duration`, send the latencies back."""
    assert callable(infer)
    perf = time.perf_counter
    stop = perf() + warmup
    while perf() < stop:
        infer()
    conn.send("ready")
    conn.recv()
    latencies = []
    stop = perf() + duration
    while True:
        t0 = perf()
        if t0 >= stop:
            break
        infer()
        latencies.append(perf() - t0)
    conn.send(latencies)
    conn.recv()  # keep the connection open until the relay's CPU has been read


@dataclass
class Relay:
    proc: subprocess.Popen[bytes]
    address: str  # where the clients connect: the gRPC or the HTTP listen port


def start_relays(
    grpc_backend: str, http_backend: str, protocol: str, repo: Path, tmp: Path,
    base_tree: Path | None = None,
) -> dict[str, Relay]:  # fmt: skip
    """Two `xsp-sidecar serve` relays: sampling off (no model repository) and at its default
    settings; for HTTP each also relays Triton's HTTP port (`--http-listen`). With `base_tree`
    (another checkout, its C extensions built or copied in) two more, "base off" and "base on",
    run that tree's code (PYTHONPATH) for an A/B of two versions in the same windows."""
    script = Path(sys.executable).with_name("xsp-sidecar")
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "sidecar"]
    on = ("--model-repository", str(repo))
    variants: list[tuple[str, tuple[str, ...], Path | None]] = [
        ("relay off", (), None), ("relay on", on, None)
    ]  # fmt: skip
    if base_tree is not None:
        variants[:0] = [("base off", (), base_tree), ("base on", on, base_tree)]
    relays: dict[str, Relay] = {}
    try:
        for name, sampling, tree in variants:
            env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
            grpc_port, http_port = free_port(), free_port()
            cmd = [
                *prefix, "--log-level", "WARNING", "serve", "--backend", grpc_backend,
                "--listen", f"127.0.0.1:{grpc_port}", "--metrics-port", str(free_port()),
                "--grpc-port", str(free_port()), "--grace-period", "1", "--otlp-port", "0",
                "--db", str(tmp / f"traces-{len(relays)}.db"), *sampling,
            ]  # fmt: skip
            port = grpc_port
            if protocol == "http":
                cmd += ["--http-listen", f"127.0.0.1:{http_port}", "--http-backend", http_backend]
                port = http_port
            proc, address = await_listening(subprocess.Popen(cmd, env=env), port, name)
            relays[name] = Relay(proc, address)
    except BaseException:
        stop_relays(relays)
        raise
    return relays


def stop_relays(relays: dict[str, Relay]) -> None:
    for relay in relays.values():
        relay.proc.send_signal(signal.SIGTERM)
        try:
            relay.proc.wait(20)
        except subprocess.TimeoutExpired:
            relay.proc.kill()
            relay.proc.wait(10)


def measure(
    args: argparse.Namespace, grpc_backend: str, http_backend: str, triton_pid: int,
    repo: Path, tmp: Path,
) -> None:  # fmt: skip
    """Every size and concurrency, the four paths alternated in `args.rounds` windows."""
    backend = http_backend if args.protocol == "http" else grpc_backend
    client = _http_client if args.protocol == "http" else _grpc_client
    base = getattr(args, "base_tree", None)
    relays = start_relays(grpc_backend, http_backend, args.protocol, repo, tmp, base)
    try:
        print(f"{args.protocol.upper()} through Triton {backend} (pid {triton_pid}); {MODEL}, "
              f"request and response of each size; {args.duration:.0f} s per path in "
              f"{args.rounds} alternating windows; CPU from /proc/<pid>/stat; socat -b "
              f"{args.socat_buffer or 8192}")  # fmt: skip
        print(GOALS)
        for size in args.sizes:
            for concurrency in args.concurrency:
                runs = alternate(args, backend, triton_pid, relays, partial(client, size=size),
                                 concurrency)  # fmt: skip
                report(size, concurrency, runs)
    finally:
        stop_relays(relays)


def alternate(
    args: argparse.Namespace, backend: str, triton_pid: int, relays: dict[str, Relay],
    client: partial[None], concurrency: int,
) -> dict[str, list[Result]]:  # fmt: skip
    """Each path's windows: direct, socat (a fresh one per window), the two relays."""
    runs: dict[str, list[Result]] = {name: [] for name in (*PATHS[:2], *relays)}
    window = args.duration / args.rounds
    for _ in range(args.rounds):
        runs["direct"].append(
            run_load(backend, concurrency, window, args.warmup, triton_pid, None, MODEL,
                     client=client)
        )  # fmt: skip
        started = start_bare_relay(backend, args.socat_buffer or None)
        if started is not None:
            bare, address = started
            try:
                runs["socat"].append(
                    run_load(address, concurrency, window, args.warmup, triton_pid, bare.pid,
                             MODEL, relay_cpu=forking_relay_cpu_seconds, client=client)
                )  # fmt: skip
            finally:
                bare.kill()
                bare.wait(10)
        for name, relay in relays.items():
            runs[name].append(
                run_load(relay.address, concurrency, window, args.warmup, triton_pid,
                         relay.proc.pid, MODEL, relay_cpu=cpu_seconds, client=client)
            )  # fmt: skip
    return runs


@dataclass(frozen=True)
class Pooled:
    calls: int
    throughput: float
    p50_ms: float  # median of the windows' p50
    cpu_us: float | None  # relay CPU per call, pooled over the windows


def pool(results: list[Result]) -> Pooled:
    n = sum(r.requests for r in results)
    seconds = sum(r.duration for r in results)
    cpu = None
    if all(r.relay_cpu_us is not None for r in results):
        cpu = sum((r.relay_cpu_us or 0.0) * r.requests for r in results) / n
    return Pooled(n, n / seconds, statistics.median(r.p50_ms for r in results), cpu)


def report(size: int, concurrency: int, runs: dict[str, list[Result]]) -> None:
    pooled = {name: pool(results) for name, results in runs.items() if results}
    direct = pooled["direct"]
    print(f"\nsize {size} B each way, concurrency {concurrency}")
    print(f"  {'':18}" + "".join(f"{name:>12}" for name in pooled))
    print(f"  {'calls':18}" + "".join(f"{p.calls:12d}" for p in pooled.values()))
    print(f"  {'calls/s':18}" + "".join(f"{p.throughput:12.0f}" for p in pooled.values()))
    print(f"  {'p50 ms':18}" + "".join(f"{p.p50_ms:12.3f}" for p in pooled.values()))
    print(f"  {'p50 added (ms)':18}"
          + "".join(f"{p.p50_ms - direct.p50_ms:+12.3f}" for p in pooled.values()))  # fmt: skip
    print(f"  {'CPU us/call':18}" + "".join(
        f"{p.cpu_us:12.1f}" if p.cpu_us is not None else f"{'-':>12}" for p in pooled.values()
    ))  # fmt: skip
    off, on = pooled["relay off"], pooled["relay on"]
    assert off.cpu_us is not None and on.cpu_us is not None
    socat = pooled.get("socat")
    if socat is None or socat.cpu_us is None:
        print("  socat: not on PATH (apt-get install socat), no ratios")
    else:
        print(f"  {'vs socat':18}{'CPU x':>12}{'calls/s x':>12}{'p50 added':>12}")
        for name, p in (("relay off", off), ("relay on", on)):
            assert p.cpu_us is not None
            cpu, tput = p.cpu_us / socat.cpu_us, p.throughput / socat.throughput
            print(f"  {name:18}{cpu:12.2f}{tput:12.3f}{(p.p50_ms - socat.p50_ms) * 1e3:+10.0f}us")
    print(f"  sampling on adds {on.cpu_us - off.cpu_us:+.1f} us/call (relay process), "
          f"throughput {on.throughput / off.throughput:.3f}x")  # fmt: skip
    base_off, base_on = pooled.get("base off"), pooled.get("base on")
    if base_off is not None and base_on is not None:
        assert base_off.cpu_us is not None and base_on.cpu_us is not None
        print(f"  vs --base-tree: CPU off {off.cpu_us - base_off.cpu_us:+.1f} us/call "
              f"({off.cpu_us / base_off.cpu_us:.3f}x), on {on.cpu_us - base_on.cpu_us:+.1f} "
              f"us/call ({on.cpu_us / base_on.cpu_us:.3f}x); base's sampling on adds "
              f"{base_on.cpu_us - base_off.cpu_us:+.1f} us/call")  # fmt: skip
        if socat is not None and socat.cpu_us is not None:
            print(f"  base vs socat: CPU x {base_off.cpu_us / socat.cpu_us:.2f} (off), calls/s x "
                  f"{base_off.throughput / socat.throughput:.3f}")  # fmt: skip


# -- frames split across reads (gRPC, in-process) ------------------------------------------------


def large_connection(size: int, calls: int, frame: int = 16384) -> tuple[bytes, bytes, int]:
    """One connection's client and backend bytes of `calls` unary ModelInfer calls of `size`
    bytes each way, DATA in frames of at most `frame` bytes (HTTP/2's default maximum), and
    the bytes of the preface (its own first chunk)."""
    import numpy as np
    from hold_replay import INFER
    from hpack import Encoder
    from stream_sampling_cost import framed
    from tritonclient.grpc import service_pb2

    from sidecar.proxy import frames
    from sidecar.proxy.frames import DATA, FLAG_END_STREAM, PREFACE, SETTINGS, frame_header

    n = elements(size)
    req = grpc_request(size)
    resp = service_pb2.ModelInferResponse(model_name=MODEL)
    for name in ("OUTPUT0", "OUTPUT1"):
        resp.outputs.add(name=name, datatype="FP32", shape=[n])
        resp.raw_output_contents.append(np.ones(n, np.float32).tobytes())
    request, response = framed(req.SerializeToString()), framed(resp.SerializeToString())  # type: ignore[attr-defined]

    def data_frames(sid: int, payload: bytes, end: bool) -> bytes:
        pieces = [payload[i : i + frame] for i in range(0, len(payload), frame)]
        return b"".join(
            frame_header(len(p), DATA, FLAG_END_STREAM if end and i == len(pieces) - 1 else 0, sid)
            + p
            for i, p in enumerate(pieces)
        )

    client, server = Encoder(), Encoder()
    settings = frame_header(0, SETTINGS, 0, 0)
    out, back = bytearray(PREFACE + settings), bytearray(settings)
    preface = len(out)
    for sid in range(1, 2 * calls, 2):
        headers = client.encode(
            [(":method", "POST"), (":scheme", "http"), (":path", INFER),
             (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")]
        )  # fmt: skip
        out += frames.header_frames(sid, headers, end_stream=False, max_frame_size=frame)
        out += data_frames(sid, request, True)
        head = server.encode([(":status", "200"), ("content-type", "application/grpc")])
        trailers = server.encode([("grpc-status", "0")])
        back += frames.header_frames(sid, head, end_stream=False, max_frame_size=frame)
        back += data_frames(sid, response, False)
        back += frames.header_frames(sid, trailers, end_stream=True, max_frame_size=frame)
    return bytes(out), bytes(back), preface


def frame_aligned(data: bytes, start: int, read: int) -> list[bytes]:
    """`data` from `start` in chunks of whole frames, each as close to `read` bytes as whole
    frames allow (the C walk handles every frame)."""
    chunks, pos, cut = [], start, start
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        pos += 9 + length
        if pos - cut >= read or pos == len(data):
            chunks.append(data[cut:pos])
            cut = pos
    return chunks


def fixed_reads(data: bytes, start: int, read: int) -> list[bytes]:
    """`data` from `start` in reads of `read` bytes, cutting frames as a socket read does."""
    return [data[i : i + read] for i in range(start, len(data), read)]


def scan_us_per_call(
    out: list[bytes], back: list[bytes], preface: bytes, calls: int, sampling: bool
) -> float:
    """µs per call of scanning both directions as the relay does (hold mode with sampling)."""
    from hold_replay import default_hook
    from prometheus_client import CollectorRegistry

    from sidecar.proxy.metrics import ProxyMetrics
    from sidecar.proxy.streams import ConnectionTracker

    tracker = ConnectionTracker(
        ProxyMetrics(CollectorRegistry()), observer=default_hook() if sampling else None
    )
    request, response = tracker.request_scanner, tracker.response_scanner

    def scan(data: bytes) -> None:
        if request.hold:
            request.process(data)
        else:
            request.observe(data)

    scan(preface)
    t0 = time.thread_time()
    for chunk in out:
        scan(chunk)
    for chunk in back:
        response.observe(chunk)
    spent = time.thread_time() - t0
    if tracker.failed or tracker.in_flight:
        raise RuntimeError("the scanned connection was not observed whole")
    return spent / calls * 1e6


def split_frame_cost(size: int, calls: int, reads: list[int], repeat: int) -> None:
    """Print µs per call of scanning `calls` calls of `size` bytes each way, in frame-aligned
    chunks and in fixed reads that split frames, sampling off and on (best of `repeat`)."""
    from sidecar.proxy import frames

    out, back, preface = large_connection(size, calls)
    head = out[:preface]
    walk = "C walk built" if frames.native_walk is not None else "C walk NOT built: Python only"
    print(f"\nframes split across reads: {calls} unary calls of {size} B each way, 16 KiB DATA "
          f"frames, scanned in-process ({walk}); best of {repeat}, us per call")  # fmt: skip
    print(f"  {'read size':12}{'sampling':10}{'aligned':>10}{'split':>10}{'split-aligned':>15}")
    for read in reads:
        cases = {}
        for name, cut in (("aligned", frame_aligned), ("split", fixed_reads)):
            cases[name] = (cut(out, preface, read), cut(back, 0, read))
        for sampling in (False, True):
            best = dict.fromkeys(cases, float("inf"))
            for _ in range(repeat):
                for name, (o, b) in cases.items():
                    us = scan_us_per_call(o, b, head, calls, sampling)
                    best[name] = min(best[name], us)
            print(f"  {read:<12}{'on' if sampling else 'off':10}{best['aligned']:10.1f}"
                  f"{best['split']:10.1f}{best['split'] - best['aligned']:+15.1f}")  # fmt: skip
