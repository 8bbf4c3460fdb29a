"""Where the relay's CPU per call goes: live under load, and the same bytes replayed hot.

Starts a local Triton and the relay under `bench/relay_shim.py` (thread-CPU clocks around
the C `data_received` of each direction (`_pump.c`: its write and its walk timed together),
the Python `data_received` callbacks and `FrameScanner.observe`, garbage-collector timing),
runs the closed-loop ModelInfer load of `proxy_overhead.py`, then replays each
connection's recorded chunks through a fresh `ConnectionTracker` in this process, with no
sockets, and prints both per call. The gap between the two is what a live relay pays for
running its Python between system calls on a shared machine (caches, scheduling), which a
hot loop does not show.

    python bench/relay_breakdown.py --duration 10 --concurrency 4

With `--sampling` the relay samples at its default settings (the model repository and a trace
store given): the client's direction is scanned in hold mode (`FrameScanner.process`), and the
breakdown adds the request header blocks handed to Python and the hook's own time; the hot
replay runs the same hook. With `--python-relay` the relay's C `data_received` is off: every
chunk goes through the Python callbacks, and observing is timed apart from forwarding.
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


def start_instrumented_relay(
    backend: str, out: Path, *extra: str, python_relay: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    shim = Path(__file__).resolve().with_name("relay_shim.py")
    cmd = [
        sys.executable, str(shim), "--log-level", "WARNING", "serve", "--backend", backend,
        "--listen", f"127.0.0.1:{port}", "--metrics-port", str(free_port()),
        "--grpc-port", str(free_port()), "--grace-period", "1", *extra,
    ]  # fmt: skip
    env = dict(os.environ, XSP_BREAKDOWN_OUT=str(out))
    env["XSP_BREAKDOWN_PYTHON_RELAY"] = "1" if python_relay else "0"
    proc = subprocess.Popen(cmd, env=env)
    return await_listening(proc, port, "the instrumented relay")


def replay(chunks: list[tuple[str, bytes]], sampling: bool, repeats: int = 5) -> tuple[float, int]:
    """Best-of-`repeats` thread-CPU µs per call of observing `chunks` (with `sampling`, the
    default hook and the client's direction in hold mode), and the calls counted."""
    from hold_replay import default_hook
    from prometheus_client import CollectorRegistry, generate_latest

    from sidecar.proxy.metrics import ProxyMetrics
    from sidecar.proxy.streams import ConnectionTracker
    from tests.harness.metrics_text import sample_sum

    best = float("inf")
    counted = 0
    for _ in range(repeats):
        registry = CollectorRegistry()
        hook = default_hook() if sampling else None
        tracker = ConnectionTracker(ProxyMetrics(registry), observer=hook)
        request = tracker.request_scanner.process if sampling else tracker.request_scanner.observe
        response = tracker.response_scanner.observe
        start = time.thread_time()
        for direction, data in chunks:
            (request if direction == "request" else response)(data)
        best = min(best, time.thread_time() - start)
        scrape = generate_latest(registry).decode()
        counted = 0 if tracker.failed else round(sample_sum(scrape, "xsp_requests_total"))
    return (best / counted * 1e6 if counted else float("inf")), counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per client")
    parser.add_argument("--concurrency", type=int, default=4, help="client processes")
    parser.add_argument("--sampling", action="store_true", help="sampling on, default settings")
    parser.add_argument(
        "--python-relay", action="store_true",
        help="the relay's C data_received off: every chunk through Python",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from tests.harness.triton.model_repo import build_model_repository
    from tests.harness.triton.server import TritonServer

    with tempfile.TemporaryDirectory(prefix="xsp-breakdown-") as tmp:
        repo = build_model_repository(Path(tmp) / "models")
        server = TritonServer(model_repository=repo, log_path=Path(tmp) / "triton.log")
        server.start()
        out = Path(tmp) / "stats.json"
        try:
            extra: tuple[str, ...] = ()
            if args.sampling:
                extra = ("--model-repository", str(repo), "--db", str(Path(tmp) / "traces.db"),
                         "--otlp-port", "0")  # fmt: skip
            proc, address = start_instrumented_relay(
                server.grpc_address, out, *extra, python_relay=args.python_relay
            )
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
    hot_us, counted = max(
        (replay(chunks, args.sampling) for chunks in recorded), key=lambda r: r[1]
    )
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
    pumped = totals.get("pump_chunks", 0) / calls
    print(f"  of which the C data_received           {per_call('pump_ns'):8.1f} us/call "
          f"({pumped:.2f} chunks per call; write and walk not split)")  # fmt: skip
    observing = per_call("observe_ns") + per_call("hold_ns")
    print(f"  of which observing in Python calls     {observing:8.1f} us/call "
          "(FrameScanner.observe / process)")  # fmt: skip
    request = per_call("observe_request_ns") + per_call("hold_ns")
    print(f"    the client's direction               {request:8.1f} us/call")
    if args.sampling:
        print(f"    hold mode (FrameScanner.process)     {per_call('hold_ns'):8.1f} us/call")
        blocks = totals.get("request_blocks", 0) / calls
        print(f"    request header blocks to Python      {per_call('request_block_ns'):8.1f} "
              f"us/call ({blocks:.2f} per call)")  # fmt: skip
        print(f"    of which the hook                    {per_call('hook_ns'):8.1f} us/call")
    print(f"  garbage collector, under load          {per_call('gc_ns'):8.1f} us/call "
          f"({totals.get('gc2_collections', 0)} full collections)")  # fmt: skip
    for gen in range(3):
        n = totals.get(f"gc{gen}_collections", 0)
        took_us = totals.get(f"gc{gen}_ns", 0) / 1e3
        print(f"    generation {gen}: {n:6d} collections, {took_us / max(n, 1):8.1f} us each, "
              f"{per_call(f'gc{gen}_ns'):5.1f} us/call")  # fmt: skip
    print(f"  observing the same bytes replayed hot  {hot_us:8.1f} us/call ({counted} calls)")
    if not pumped:
        print(f"  live / replayed observing              {observing / hot_us:8.1f}x")
    print(f"  (each timed section includes ~{2 * CLOCK_READ_US:.1f} us of clock reads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
