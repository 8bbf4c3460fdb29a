"""What sampling costs the serving path: the same load through a sidecar with sampling off
and through one that samples (and profiles in its worker process) as fast as its duty-cycle
cap allows.

One run, one process tree: a real `tritonserver` from `sidecar.localtriton`, two
`xsp-sidecar serve` subprocesses in front of it (sampling off: no --model-repository;
sampling on: every request is a candidate, the budget is unlimited, so the worker's duty
cycle is the only limit), and closed-loop clients in separate processes sending unary
ModelInfer for `simple_cnn` (the sample ONNX model, which the worker replays with M and L
levels). Prints throughput, p50 and p99 for both and the on/off ratios (goal: throughput
>= 0.95, p99 <= 1.10), beside how many profiles ran (and per minute: the trade) and the
worker's CPU share.

    python bench/sampling_impact.py --duration 10
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_overhead import Result, cpu_seconds, run_load, start_relay, tree_cpu_seconds

from sidecar.metrics_text import sample_sum, scrape


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
    args = parser.parse_args(argv)

    from sidecar.localtriton.model_repo import build_model_repository
    from sidecar.localtriton.server import TritonServer, free_port

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
                f"{args.duration:.0f} s per measurement; sample rate {args.sample_rate}, "
                f"duty-cycle cap {args.duty_cycle}"
            )
            for concurrency in args.concurrency:
                result_off = run_load(
                    off_address, concurrency, args.duration, args.warmup, server.pid, off.pid,
                    model="simple_cnn",
                )  # fmt: skip
                before = scrape_sum(on_metrics, "xsp_profiles_total")
                worker_before = worker_cpu_seconds(on.pid)
                result_on = run_load(
                    on_address, concurrency, args.duration, args.warmup, server.pid, on.pid,
                    model="simple_cnn",
                )  # fmt: skip
                # (includes the clients' warm-up: an upper bound for the measured window)
                worker_cpu = worker_cpu_seconds(on.pid) - worker_before
                profiles = scrape_sum(on_metrics, "xsp_profiles_total") - before
                window = result_on.duration + args.warmup
                share = worker_cpu / window
                report(concurrency, result_off, result_on, profiles, window, share)
        finally:
            for proc in (off, on):
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
