"""What sampling costs the serving path: the same load through a sidecar with sampling off
and through one that samples (and profiles in its worker process) as fast as its duty-cycle
cap allows.

One run, one process tree: a real `tritonserver` from `tests.harness.triton`, two
`xsp-sidecar serve` subprocesses in front of it (sampling off: no --model-repository;
sampling on: every request is a candidate, the budget is unlimited, so the worker's duty
cycle is the only limit), and closed-loop clients in separate processes sending unary
ModelInfer for `simple_cnn` (the sample ONNX model, which the worker replays with M and L
levels). Prints throughput, p50 and p99 for both and the on/off ratios (goal: throughput
>= 0.95, p99 <= 1.10), beside how many profiles ran (and per minute: the trade) and the
worker's CPU share.

The machine may be shared, and its background load drifts on a scale of seconds, so the two
sides are measured in alternating windows (`--rounds`, default 5: off, on, off, on, ...; the
same client processes stay connected throughout) and each side's latencies are pooled; after
each 'on' window the worker gets `--settle` seconds to finish its profile before the next 'off'
window starts. `--rounds 1` measures as before the change: all of 'off', then all of 'on'.

    python bench/sampling_impact.py --duration 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import signal
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness
from proxy_overhead import Result, cpu_seconds, infer_request, start_relay, tree_cpu_seconds

from tests.harness.metrics_text import sample_sum, scrape


def metrics_port(proc_args: list[str]) -> int:
    return int(proc_args[proc_args.index("--metrics-port") + 1])


def scrape_sum(port: int, name: str, **labels: str) -> float:
    return sample_sum(scrape(f"http://127.0.0.1:{port}/metrics"), name, **labels)


def report(
    concurrency: int, off: Result, on: Result, profiles: float, window_s: float, worker_share: float
) -> None:
    print(f"\nconcurrency {concurrency}  ({off.requests} calls sampling off / {on.requests} on)")
    print(f"  {'':22}{'off':>12}{'on':>12}{'on/off':>10}")
    rows = [
        ("throughput (req/s)", off.throughput, on.throughput, "{:12.0f}"),
        ("p50 latency (ms)", off.p50_ms, on.p50_ms, "{:12.3f}"),
        ("p99 latency (ms)", off.p99_ms, on.p99_ms, "{:12.3f}"),
    ]
    if off.relay_cpu_us is not None and on.relay_cpu_us is not None:
        rows.append(("sidecar CPU (us/req)", off.relay_cpu_us, on.relay_cpu_us, "{:12.1f}"))
    for name, a, b, fmt in rows:
        print(f"  {name:22}{fmt.format(a)}{fmt.format(b)}{b / a:10.3f}")
    per_minute = profiles * 60 / window_s
    print(f"  profiles completed while on: {profiles:.0f} ({per_minute:.1f} per minute); "
          f"worker CPU {worker_share * 100:.1f}% of wall time")  # fmt: skip


def _window_client(address: str, warmup: float, conn: Connection) -> None:
    """One closed-loop client process that stays connected: warm up once, then for every
    number of seconds it receives run that long and send the latencies back (None: stop)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    req = infer_request("simple_cnn")
    channel = grpc.insecure_channel(address)
    infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
    perf = time.perf_counter
    stop = perf() + warmup
    while perf() < stop:
        infer(req)
    conn.send("ready")
    while (seconds := conn.recv()) is not None:
        latencies = []
        stop = perf() + seconds
        while (t0 := perf()) < stop:
            infer(req)
            latencies.append(perf() - t0)
        conn.send(latencies)
    channel.close()


class Side:
    """The clients of one sidecar and what its windows measured, pooled."""

    def __init__(self, address: str, relay_pid: int, concurrency: int, warmup: float) -> None:
        ctx = mp.get_context("spawn")
        self.relay_pid = relay_pid
        self.pipes: list[Connection] = []
        self.procs = []
        for _ in range(concurrency):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_window_client, args=(address, warmup, child), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a client process failed to warm up")
        self.latencies: list[float] = []
        self.seconds = 0.0
        self.relay_cpu = 0.0

    def window(self, seconds: float) -> None:
        relay0, start = cpu_seconds(self.relay_pid), time.perf_counter()
        for pipe in self.pipes:
            pipe.send(seconds)
        for pipe in self.pipes:
            self.latencies.extend(pipe.recv())
        self.seconds += time.perf_counter() - start
        self.relay_cpu += cpu_seconds(self.relay_pid) - relay0

    def close(self) -> Result:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(10)
        latencies, n = sorted(self.latencies), len(self.latencies)
        return Result(
            requests=n,
            duration=self.seconds,
            p50_ms=statistics.median(latencies) * 1e3,
            p99_ms=latencies[min(n - 1, int(n * 0.99))] * 1e3,
            relay_cpu_us=self.relay_cpu / n * 1e6,
            triton_cpu_us=0.0,
        )


def worker_cpu_seconds(sidecar_pid: int) -> float:
    """CPU of the sidecar's child processes (the profiling worker), not of the relay itself."""
    return tree_cpu_seconds(sidecar_pid) - cpu_seconds(sidecar_pid)


def prime(address: str, metrics: int, wait_s: float) -> None:
    """One profile before measuring, so the worker's one-time costs (runtime imports, session
    creation, peak measurement) are not in the numbers; then wait for the gate to reopen."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(address)
    x = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.ones((1, 3, 32, 32), np.float32))
    deadline = time.monotonic() + 120
    while scrape_sum(metrics, "xsp_profiles_total") < 1 and time.monotonic() < deadline:
        client.infer("simple_cnn", [x])
        time.sleep(0.2)
    client.close()
    time.sleep(wait_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per client")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4], help="client processes (default 1 4)"
    )
    parser.add_argument("--duty-cycle", default="0.05", help="worker duty-cycle cap (0.05)")
    parser.add_argument(
        "--sample-rate", default="1", help="sampling probability of the 'on' sidecar (default 1)"
    )
    parser.add_argument(
        "--prime-wait", type=float, default=15.0,
        help="seconds to wait after the priming profile (its gate must reopen; default 15)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=5,
        help="alternating off/on windows each measurement is split into (default 5)",
    )  # fmt: skip
    parser.add_argument(
        "--settle", type=float, default=0.5,
        help="seconds after each 'on' window before the next 'off' one (default 0.5)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from tests.harness.process import free_port
    from tests.harness.triton.model_repo import build_model_repository
    from tests.harness.triton.server import TritonServer

    with tempfile.TemporaryDirectory(prefix="xsp-bench-") as tmp:
        repo = build_model_repository(Path(tmp) / "models")
        server = TritonServer(model_repository=repo, log_path=Path(tmp) / "triton.log").start()
        on_metrics = free_port()
        off, off_address = start_relay(server.grpc_address)
        on, on_address = start_relay(
            server.grpc_address, "--model-repository", str(repo), "--db", f"{tmp}/traces.db",
            "--otlp-port", "0", "--sample-rate", args.sample_rate, "--sample-budget", "1000000",
            "--duty-cycle", args.duty_cycle, "--metrics-port", str(on_metrics),
        )  # fmt: skip
        try:
            prime(on_address, on_metrics, args.prime_wait)
            print(f"Triton {server.grpc_address}; sidecar off {off_address}, on {on_address}")
            print(
                f"{args.duration:.0f} s per measurement in {args.rounds} alternating windows; "
                f"sample rate {args.sample_rate}, duty-cycle cap {args.duty_cycle}"
            )
            for concurrency in args.concurrency:
                side_off = Side(off_address, off.pid, concurrency, args.warmup)
                side_on = Side(on_address, on.pid, concurrency, args.warmup)
                profiles = worker_cpu = on_window = 0.0
                for _ in range(args.rounds):
                    side_off.window(args.duration / args.rounds)
                    before = scrape_sum(on_metrics, "xsp_profiles_total")
                    worker_before, start = worker_cpu_seconds(on.pid), time.perf_counter()
                    side_on.window(args.duration / args.rounds)
                    time.sleep(args.settle)  # the profile under way ends before 'off' runs
                    on_window += time.perf_counter() - start
                    worker_cpu += worker_cpu_seconds(on.pid) - worker_before
                    profiles += scrape_sum(on_metrics, "xsp_profiles_total") - before
                result_off, result_on = side_off.close(), side_on.close()
                report(
                    concurrency, result_off, result_on, profiles, on_window, worker_cpu / on_window
                )
        finally:
            for proc in (off, on):
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
