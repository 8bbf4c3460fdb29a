"""Where the relay's CPU per call goes: live under load, and the same bytes replayed hot.

Starts a local Triton and the relay under `bench/relay_shim.py` (thread-CPU clocks around
the two `data_received` callbacks and `FrameScanner.observe`, garbage-collector timing),
runs the closed-loop ModelInfer load of `proxy_overhead.py`, then replays each
connection's recorded chunks through a fresh `ConnectionTracker` in this process, with no
sockets, and prints both per call. The gap between the two is what a live relay pays for
running its Python between system calls on a shared machine (caches, scheduling), which a
hot loop does not show.

    python bench/relay_breakdown.py --duration 10 --concurrency 4
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

from proxy_overhead import await_listening, run_load

from tests.harness.process import free_port

CLOCK_READ_US = 0.5  # one thread-CPU clock read, roughly; each timed section pays two


def start_instrumented_relay(backend: str, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    shim = Path(__file__).resolve().with_name("relay_shim.py")
    cmd = [
        sys.executable, str(shim), "--log-level", "WARNING", "serve", "--backend", backend,
        "--listen", f"127.0.0.1:{port}", "--metrics-port", str(free_port()),
        "--grpc-port", str(free_port()), "--grace-period", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ, XSP_BREAKDOWN_OUT=str(out)))
    return await_listening(proc, port, "the instrumented relay")


def replay(chunks: list[tuple[str, bytes]], repeats: int = 5) -> tuple[float, int]:
    """Best-of-`repeats` thread-CPU µs per call of observing `chunks`, and the calls counted."""
    from prometheus_client import CollectorRegistry, generate_latest

    from sidecar.proxy.metrics import ProxyMetrics
    from sidecar.proxy.streams import ConnectionTracker
    from tests.harness.metrics_text import sample_sum

    best = float("inf")
    counted = 0
    for _ in range(repeats):
        registry = CollectorRegistry()
        tracker = ConnectionTracker(ProxyMetrics(registry))
        request, response = tracker.request_scanner, tracker.response_scanner
        start = time.thread_time()
        for direction, data in chunks:
            (request if direction == "request" else response).observe(data)
        best = min(best, time.thread_time() - start)
        scrape = generate_latest(registry).decode()
        counted = 0 if tracker.failed else round(sample_sum(scrape, "xsp_requests_total"))
    return (best / counted * 1e6 if counted else float("inf")), counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per client")
    parser.add_argument("--concurrency", type=int, default=4, help="client processes")
    args = parser.parse_args(argv)

    from tests.harness.triton.model_repo import build_model_repository
    from tests.harness.triton.server import TritonServer

    with tempfile.TemporaryDirectory(prefix="xsp-breakdown-") as tmp:
        repo = build_model_repository(Path(tmp) / "models")
        server = TritonServer(model_repository=repo, log_path=Path(tmp) / "triton.log")
        server.start()
        out = Path(tmp) / "stats.json"
        try:
            proc, address = start_instrumented_relay(server.grpc_address, out)
            try:
                result = run_load(
                    address, args.concurrency, args.duration, args.warmup, server.pid, proc.pid
                )
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        finally:
            server.stop()
        stats = json.loads(out.read_text())
    totals = stats["totals"]
    recorded = [
        [(d, base64.b64decode(b)) for d, b in connection] for connection in stats["connections"]
    ]
    calls = max(totals.get("calls", 0), 1)  # every call the relay saw, warm-up included
    # the connection whose replay counts the most calls (one per client process)
    hot_us, counted = max((replay(chunks) for chunks in recorded), key=lambda r: r[1])
    if not counted:
        raise RuntimeError("no recorded connection replayed a call (observation failed?)")

    def per_call(key: str) -> float:
        return totals.get(key, 0) / calls / 1e3

    print(f"concurrency {args.concurrency}, {args.duration:.0f} s of load: {result.requests} calls")
    print(f"  relay process CPU (instrumented)       {result.relay_cpu_us:8.1f} us/call")
    print(f"  request chunks per call                {totals['request_chunks'] / calls:8.2f}")
    print(f"  response chunks per call               "
          f"{totals.get('response_chunks', 0) / calls:8.2f}")  # fmt: skip
    print(f"  in data_received, both directions      "
          f"{per_call('request_ns') + per_call('response_ns'):8.1f} us/call "
          "(forward + observe, thread CPU)")  # fmt: skip
    print(f"  of which observing (FrameScanner)      {per_call('observe_ns'):8.1f} us/call")
    print(f"  garbage collector                      {per_call('gc_ns'):8.1f} us/call "
          f"({totals.get('gc2_collections', 0)} full collections)")  # fmt: skip
    print(f"  observing the same bytes replayed hot  {hot_us:8.1f} us/call ({counted} calls)")
    print(f"  live / replayed observing              {per_call('observe_ns') / hot_us:8.1f}x")
    print(f"  (each timed section includes ~{2 * CLOCK_READ_US:.1f} us of clock reads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
