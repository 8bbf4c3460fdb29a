"""What the relay costs: the same closed-loop load direct to Triton and through the relay.

One run, one process tree: a real `tritonserver` (started here from `tests.harness.triton`
unless `--backend` points at a running one), the relay as an `xsp-sidecar serve` subprocess,
and closed-loop clients in separate processes (one in-flight unary ModelInfer on `add_sub`
each, `--concurrency` processes) so the clients' CPU does not hide the relay's. For each
concurrency it prints throughput, p50 and p99 direct and relayed, their ratios, and CPU
microseconds per request of the relay process and of Triton (its process tree, Python-backend
stubs included), read from /proc/<pid>/stat.

With `socat` on PATH it also relays the same load through socat (a C byte copier, one process
per connection, no HTTP/2 parsing): the floor any relay pays on this machine for the extra hop,
measured in the same run. With a local Triton it also prints NVIDIA's load generator's numbers
for both paths: `perf_analyzer` from PATH, else from the tritonclient 2.51 wheel
(bench/perf_analyzer.py takes it once into `.cache/`).

    python bench/proxy_overhead.py --duration 10

`--sampling-ab` compares relays instead, all in front of the same Triton and started with its
model repository: sampling off (no `--model-repository`), sampling at its default settings,
those plus `--sample-slow p99`, and plus `--sample-slow p99 --sample-budget 0` (every body held
until its response ends, nothing profiled: the gate never closes). Each measurement is split
into `--rounds` windows taken in turn (off, default, p99, p99 held, off, ...), so drift in the
machine's load falls on all of them; it prints each relay's CPU per request, throughput and
the median of its windows' p50, and their differences to sampling off. The relays run under
`bench/thread_names_shim.py` (each Python thread's name given to its OS thread), so it also
prints where each relay's CPU went by thread (/proc/<pid>/task/*/schedstat): with no traffic
for `--idle` seconds (ms of CPU per second), and under each load (µs per request).

    python bench/proxy_overhead.py --sampling-ab --duration 30 --rounds 6

With `--streaming` the same closed-loop load also runs as inferences on one `ModelStreamInfer`
stream per client (grpc.aio: write a message, read its response), direct, relayed and through
socat, and the relay's CPU per inference on a stream is printed beside its CPU per unary call,
also as what it costs above socat's.

    python bench/proxy_overhead.py --duration 10 [--streaming]

`--sizes` (issue 44) and `--protocol http` (issue 42) measure the relay beside socat at the
given request and response sizes (`bench/size_floor.py`): direct, socat, the relay with
sampling off and with sampling at its default settings, alternated in `--rounds` windows, at
each `--concurrency`; side by side the relay's CPU per call / socat's, throughput / socat's, p50
added, and what sampling on adds. `--protocol http` sends KServe v2 binary-tensor infer calls
over keep-alive HTTP/1.1 through the sidecar's HTTP relay (`serve --http-listen`) and socat in
front of Triton's HTTP port. With gRPC and a size of 1 MiB or more it also measures, in-process,
what DATA frames split across reads cost where the C walk hands a chunk to Python.

    python bench/proxy_overhead.py --sizes 16 48K 2M --duration 20 --rounds 4 [--protocol http]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

from tests.harness.process import free_port

CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")  # what `drive_clients` measures around its window


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """utime + stime of one process, in seconds; with `reaped_children`, plus those of the
    children it has already waited for (cutime + cstime)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    used = (11, 12, 13, 14) if reaped_children else (11, 12)
    return sum(int(fields[i]) for i in used) / CLK_TCK


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """On-CPU seconds of each of `pid`'s live threads, summed by thread name (`comm`; named
    after the Python thread under `thread_names_shim.py`), from /proc/<pid>/task/*/schedstat
    (nanoseconds, not the stat file's clock ticks)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                name = fh.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                seconds = int(fh.read().split()[0]) / 1e9
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def thread_cpu_delta(pid: int, before: dict[str, float]) -> dict[str, float]:
    """Each live thread name's CPU seconds since `before` (a thread that ended meanwhile is
    not counted: the relay's threads live as long as it does)."""
    after = thread_cpu_seconds(pid)
    return {name: after[name] - before.get(name, 0.0) for name in after}


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (Triton's Python-backend stubs are child processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def forking_relay_cpu_seconds(pid: int) -> float:
    """CPU of a relay that forks a process per connection (socat): the parent, the children
    it has reaped, and the children still running (their CPU is not in the parent's yet)."""
    total = cpu_seconds(pid, reaped_children=True)
    for member in process_tree(pid)[1:]:
        with contextlib.suppress(OSError):
            total += cpu_seconds(member)
    return total


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(member)
    return total


def infer_request(model: str) -> object:
    """A small ModelInferRequest for one of the sample models (`add_sub` or `simple_cnn`)."""
    import numpy as np
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model)
    if model == "simple_cnn":
        req.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 32])
        req.raw_input_contents.append(np.ones((1, 3, 32, 32), dtype=np.float32).tobytes())
        return req
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[16])
        req.raw_input_contents.append(np.arange(16, dtype=np.float32).tobytes())
    return req


def _client(
    address: str, duration: float, warmup: float, conn: Connection, model: str = "add_sub"
) -> None:
    """One closed-loop client process: warm up, wait for 'go', run, send latencies back."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    req = infer_request(model)
    channel = grpc.insecure_channel(address)
    infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
    stop = time.perf_counter() + warmup
    while time.perf_counter() < stop:
        infer(req)
    conn.send("ready")
    conn.recv()
    latencies = []
    perf = time.perf_counter
    stop = perf() + duration
    while True:
        t0 = perf()
        if t0 >= stop:
            break
        infer(req)
        latencies.append(perf() - t0)
    conn.send(latencies)
    conn.recv()  # keep the connection open until the relay's CPU has been read
    channel.close()


def _stream_client(
    address: str, duration: float, warmup: float, conn: Connection, model: str = "add_sub"
) -> None:
    """`_client` on one `ModelStreamInfer` stream (grpc.aio): each inference is one request
    message, its response read before the next is written (one in flight, closed loop)."""
    import asyncio

    import grpc
    from tritonclient.grpc import service_pb2_grpc

    async def main() -> None:
        req = infer_request(model)
        async with grpc.aio.insecure_channel(address) as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
            perf = time.perf_counter

            async def infer() -> None:
                await call.write(req)
                reply = await call.read()
                if reply is grpc.aio.EOF or reply.error_message:
                    raise RuntimeError(f"stream inference failed: {reply}")

            stop = perf() + warmup
            while perf() < stop:
                await infer()
            conn.send("ready")
            await asyncio.to_thread(conn.recv)
            latencies = []
            stop = perf() + duration
            while True:
                t0 = perf()
                if t0 >= stop:
                    break
                await infer()
                latencies.append(perf() - t0)
            await call.done_writing()
            conn.send(latencies)
            await asyncio.to_thread(conn.recv)  # the stream's end is read with the relay's CPU

    asyncio.run(main())


@dataclass
class Result:
    requests: int
    duration: float
    p50_ms: float
    p99_ms: float
    relay_cpu_us: float | None
    triton_cpu_us: float
    threads: dict[str, float] | None = None  # the relay's CPU seconds by thread name

    @property
    def throughput(self) -> float:
        return self.requests / self.duration


def drive_clients(
    address: str, concurrency: int, duration: float, warmup: float,
    on_ready: Callable[[], Callable[[], T]], model: str = "add_sub",
    client: Callable[..., None] = _client,
) -> tuple[list[float], float, T]:  # fmt: skip
    """`concurrency` client processes, warmed up, then timed for `duration` at once: every
    call's latency, the seconds they ran, and what `on_ready` measured. `on_ready()` runs once
    the clients are connected and warm; the function it returns runs when they are done."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(concurrency):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=client, args=(address, duration, warmup, child, model), daemon=True
        )
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for pipe in pipes:
        if pipe.recv() != "ready":
            raise RuntimeError("a client process failed to warm up")
    finish = on_ready()
    start = time.perf_counter()
    for pipe in pipes:
        pipe.send("go")
    latencies: list[float] = []
    for pipe in pipes:
        latencies.extend(pipe.recv())
    elapsed = time.perf_counter() - start
    measured = finish()
    for pipe in pipes:
        pipe.send("close")
    for proc in procs:
        proc.join(10)
    return latencies, elapsed, measured


def run_load(
    address: str, concurrency: int, duration: float, warmup: float, triton_pid: int,
    relay_pid: int | None, model: str = "add_sub", relay_cpu: Callable[[int], float] = cpu_seconds,
    client: Callable[..., None] = _client, by_thread: bool = False,
) -> Result:  # fmt: skip
    def on_ready() -> Callable[[], tuple[float, float | None, dict[str, float] | None]]:
        triton0 = tree_cpu_seconds(triton_pid)
        relay0 = relay_cpu(relay_pid) if relay_pid else 0.0
        threads0 = thread_cpu_seconds(relay_pid) if by_thread and relay_pid else None

        def finish() -> tuple[float, float | None, dict[str, float] | None]:
            triton_cpu = tree_cpu_seconds(triton_pid) - triton0
            relay_seconds = relay_cpu(relay_pid) - relay0 if relay_pid else None
            threads = (
                thread_cpu_delta(relay_pid, threads0)
                if threads0 is not None and relay_pid
                else None
            )
            return triton_cpu, relay_seconds, threads

        return finish

    latencies, elapsed, (triton_cpu, relay_seconds, threads) = drive_clients(
        address, concurrency, duration, warmup, on_ready, model, client
    )
    n = len(latencies)
    latencies.sort()
    return Result(
        requests=n,
        duration=elapsed,
        p50_ms=statistics.median(latencies) * 1e3,
        p99_ms=latencies[min(n - 1, int(n * 0.99))] * 1e3,
        relay_cpu_us=relay_seconds / n * 1e6 if relay_seconds is not None else None,
        triton_cpu_us=triton_cpu / n * 1e6,
        threads=threads,
    )


def start_relay(
    backend: str, *extra: str, named_threads: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    """`xsp-sidecar serve` in front of `backend`; with `named_threads`, under
    `thread_names_shim.py` (its threads named for a per-thread CPU reading)."""
    port = free_port()
    script = Path(sys.executable).with_name("xsp-sidecar")
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "sidecar"]
    if named_threads:
        prefix = [sys.executable, str(Path(__file__).resolve().with_name("thread_names_shim.py"))]
    cmd = [
        *prefix, "--log-level", "WARNING", "serve", "--backend", backend,
        "--listen", f"127.0.0.1:{port}", "--metrics-port", str(free_port()),
        "--grpc-port", str(free_port()), "--grace-period", "1", *extra,
    ]  # fmt: skip
    return await_listening(subprocess.Popen(cmd), port, "the relay")


def await_listening(
    proc: subprocess.Popen[bytes], port: int, what: str, timeout: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Wait until `proc` accepts connections on 127.0.0.1:`port`; kill it if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not start listening within {timeout:.0f} s")


def start_bare_relay(
    backend: str, buffer: int | None = None
) -> tuple[subprocess.Popen[bytes], str] | None:
    """socat relaying raw TCP to `backend` (a process per connection), or None without socat;
    `buffer`: its transfer block size (`-b`; socat's own default is 8192 bytes)."""
    binary = shutil.which("socat")
    if binary is None:
        return None
    port = free_port()
    host, _, backend_port = backend.rpartition(":")
    block = ["-b", str(buffer)] if buffer else []
    proc = subprocess.Popen(
        [binary, *block, f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,nodelay",
         f"TCP:{host}:{backend_port},nodelay"],
    )  # fmt: skip
    return await_listening(proc, port, "socat")


def report_bare(
    concurrency: int, direct: Result, bare: Result, relay: Result, unit: str = "req"
) -> None:
    """The bare TCP relay beside ours: what the extra hop alone costs here."""
    assert bare.relay_cpu_us is not None and relay.relay_cpu_us is not None
    what = "calls" if unit == "req" else "inferences on one stream per client"
    print(f"  bare TCP relay (socat, C), same load: {bare.requests} {what}")
    print(f"  {'':22}{'socat':>12}{'relay':>12}")
    print(f"  {'throughput / direct':22}{bare.throughput / direct.throughput:12.3f}"
          f"{relay.throughput / direct.throughput:12.3f}")  # fmt: skip
    print(f"  {'p50 added (ms)':22}{bare.p50_ms - direct.p50_ms:+12.3f}"
          f"{relay.p50_ms - direct.p50_ms:+12.3f}")  # fmt: skip
    print(f"  {f'CPU (us/{unit})':22}{bare.relay_cpu_us:12.1f}{relay.relay_cpu_us:12.1f}")


def report_streaming_floor(unary: tuple[Result, Result], stream: tuple[Result, Result]) -> None:
    """Relay CPU above socat's, per inference on a stream and per unary call (socat, relay)."""
    above_unary, above_stream = (_cpu(relay) - _cpu(bare) for bare, relay in (unary, stream))
    print(f"  relay CPU above socat, stream / unary: {above_stream:.1f} / {above_unary:.1f} us"
          f" = {above_stream / above_unary:.3f}")  # fmt: skip


def _cpu(result: Result) -> float:
    assert result.relay_cpu_us is not None
    return result.relay_cpu_us


def report(concurrency: int, direct: Result, relay: Result) -> None:
    print(
        f"\nconcurrency {concurrency}  ({direct.requests} direct / {relay.requests} relayed calls)"
    )
    print(f"  {'':22}{'direct':>12}{'relay':>12}{'relay/direct':>14}")
    rows = [
        ("throughput (req/s)", direct.throughput, relay.throughput, "{:12.0f}"),
        ("p50 latency (ms)", direct.p50_ms, relay.p50_ms, "{:12.3f}"),
        ("p99 latency (ms)", direct.p99_ms, relay.p99_ms, "{:12.3f}"),
        ("Triton CPU (us/req)", direct.triton_cpu_us, relay.triton_cpu_us, "{:12.1f}"),
    ]
    for name, d, r, fmt in rows:
        print(f"  {name:22}{fmt.format(d)}{fmt.format(r)}{r / d:14.3f}")
    assert relay.relay_cpu_us is not None
    print(f"  {'relay CPU (us/req)':22}{'-':>12}{relay.relay_cpu_us:12.1f}")
    print(f"  p50 added by the relay: {relay.p50_ms - direct.p50_ms:+.3f} ms")


def report_streaming(concurrency: int, unary: Result, direct: Result, relay: Result) -> None:
    """Inferences on one stream per client beside the unary calls of the same run."""
    assert unary.relay_cpu_us is not None and relay.relay_cpu_us is not None
    print(f"  ModelStreamInfer, one stream per client: {direct.requests} direct / "
          f"{relay.requests} relayed inferences")  # fmt: skip
    print(f"  {'':22}{'direct':>12}{'relay':>12}{'relay/direct':>14}")
    for name, d, r, fmt in (
        ("throughput (inf/s)", direct.throughput, relay.throughput, "{:12.0f}"),
        ("p50 latency (ms)", direct.p50_ms, relay.p50_ms, "{:12.3f}"),
        ("p99 latency (ms)", direct.p99_ms, relay.p99_ms, "{:12.3f}"),
    ):
        print(f"  {name:22}{fmt.format(d)}{fmt.format(r)}{r / d:14.3f}")
    print(f"  {'relay CPU (us/inf)':22}{'-':>12}{relay.relay_cpu_us:12.1f}")
    ratio = relay.relay_cpu_us / unary.relay_cpu_us
    print(f"  relay CPU per inference, stream / unary: {relay.relay_cpu_us:.1f} / "
          f"{unary.relay_cpu_us:.1f} us = {ratio:.3f}")  # fmt: skip


def perf_analyzer_report(
    direct: str, relay: str, concurrencies: list[int], seconds: float, libs: Path
) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import perf_analyzer as pa

    binary = pa.find_binary()
    if binary is None:
        print("\nperf_analyzer: not found, skipped")
        return
    print("\nperf_analyzer (NVIDIA), add_sub, same two paths")
    print(f"  {'concurrency':12}{'':10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for concurrency in concurrencies:
        try:
            d = pa.run(binary, direct, concurrency, seconds, libs)
            r = pa.run(binary, relay, concurrency, seconds, libs)
        except subprocess.CalledProcessError as exc:  # its own words, not only the exit code
            said = (exc.stderr or exc.stdout or "").strip().splitlines() or ["(no output)"]
            print(f"  perf_analyzer failed (exit {exc.returncode}): {said[-1]}")
            return
        except (OSError, subprocess.SubprocessError, StopIteration) as exc:
            print(f"  perf_analyzer failed: {exc}")
            return
        for name, x in (("direct", d), ("relay", r)):
            print(
                f"  {concurrency:<12}{name:10}{x.throughput:10.0f}{x.p50_ms:10.3f}{x.p99_ms:10.3f}"
            )
        print(f"  {'':12}{'ratio':10}{r.throughput / d.throughput:10.3f}"
              f"{r.p50_ms / d.p50_ms:10.3f}{r.p99_ms / d.p99_ms:10.3f}")  # fmt: skip


SAMPLING_MODES = {  # name -> extra `serve` flags besides the model repository and a store
    "sampling off": None,
    "default": (),
    "slow p99": ("--sample-slow", "p99"),
    "p99, all held": ("--sample-slow", "p99", "--sample-budget", "0"),
}


def sampling_ab(
    backend: str, triton_pid: int, repo: Path, tmp: Path, args: argparse.Namespace
) -> None:
    """Relays that differ in their sampling settings, measured in alternating windows."""
    relays: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for i, (name, extra) in enumerate(SAMPLING_MODES.items()):
            flags: tuple[str, ...] = ()
            if extra is not None:
                store = ("--db", str(tmp / f"traces-{i}.db"), "--otlp-port", "0")
                flags = ("--model-repository", str(repo), *store, *extra)
            relays[name] = start_relay(backend, *flags, named_threads=True)
        print(f"Triton {backend}; {args.model}; {args.duration:.0f} s per relay and concurrency "
              f"in {args.rounds} alternating windows; CPU from /proc/<pid>/stat")  # fmt: skip
        if args.idle > 0:
            report_threads(
                f"idle (no traffic, {args.idle:.0f} s each): relay CPU by thread, ms/s",
                {name: [idle_threads(proc.pid, args.idle)] for name, (proc, _) in relays.items()},
                scale=dict.fromkeys(relays, 1e3 / args.idle),
            )
        for concurrency in args.concurrency:
            runs: dict[str, list[Result]] = {name: [] for name in relays}
            for _ in range(args.rounds):
                for name, (proc, address) in relays.items():
                    runs[name].append(
                        run_load(address, concurrency, args.duration / args.rounds,
                                 args.warmup, triton_pid, proc.pid, args.model, by_thread=True)
                    )  # fmt: skip
            report_sampling(concurrency, runs)
            report_threads(
                f"concurrency {concurrency}: relay CPU by thread, us/req",
                {name: [r.threads or {} for r in results] for name, results in runs.items()},
                scale={name: 1e6 / sum(r.requests for r in rs) for name, rs in runs.items()},
            )
    finally:
        for proc, _ in relays.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)


def idle_threads(pid: int, seconds: float) -> dict[str, float]:
    """The relay's CPU seconds by thread over `seconds` with no traffic."""
    before = thread_cpu_seconds(pid)
    time.sleep(seconds)
    return thread_cpu_delta(pid, before)


def report_threads(
    title: str, windows: dict[str, list[dict[str, float]]], scale: dict[str, float]
) -> None:
    """One row per thread name, one column per relay: its CPU seconds over all its windows
    times `scale[relay]` (1e6 / requests: us per request; 1e3 / seconds: ms per second)."""
    totals = {
        relay: {name: sum(w.get(name, 0.0) for w in ws) * scale[relay] for name in _names(ws)}
        for relay, ws in windows.items()
    }
    names = sorted({n for t in totals.values() for n in t})
    print(f"  {title}")
    print(f"  {'thread':18}" + "".join(f"{relay:>15}" for relay in totals))
    for name in names:
        print(f"  {name:18}" + "".join(f"{t.get(name, 0.0):15.1f}" for t in totals.values()))
    print(f"  {'all threads':18}" + "".join(f"{sum(t.values()):15.1f}" for t in totals.values()))


def _names(windows: list[dict[str, float]]) -> set[str]:
    return {name for w in windows for name in w}


def report_sampling(concurrency: int, runs: dict[str, list[Result]]) -> None:
    pooled = {}
    for name, results in runs.items():
        n = sum(r.requests for r in results)
        cpu = sum((r.relay_cpu_us or 0.0) * r.requests for r in results) / n
        seconds = sum(r.duration for r in results)
        pooled[name] = (cpu, n / seconds, statistics.median(r.p50_ms for r in results), n)
    base_cpu, base_tput, base_p50, _ = pooled["sampling off"]
    print(f"\nconcurrency {concurrency}")
    print(f"  {'relay':16}{'calls':>9}{'CPU us/req':>12}{'- off':>9}{'req/s':>9}"
          f"{'/ off':>8}{'p50 ms':>9}{'- off':>9}")  # fmt: skip
    for name, (cpu, tput, p50, n) in pooled.items():
        print(f"  {name:16}{n:9d}{cpu:12.1f}{cpu - base_cpu:+9.1f}{tput:9.0f}"
              f"{tput / base_tput:8.3f}{p50:9.3f}{p50 - base_p50:+9.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per client")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4], help="client processes (default 1 4)"
    )
    parser.add_argument(
        "--streaming", action="store_true",
        help="also the same load as inferences on one ModelStreamInfer stream per client",
    )  # fmt: skip
    parser.add_argument("--backend", help="use a running Triton at HOST:PORT (needs --triton-pid)")
    parser.add_argument("--triton-pid", type=int, help="pid of that Triton, for its CPU time")
    parser.add_argument(
        "--sampling-ab", action="store_true",
        help="compare relays by their sampling settings (off, default, --sample-slow p99)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=4, help="alternating windows for --sampling-ab (4)"
    )
    parser.add_argument(
        "--model", default="add_sub", help="--sampling-ab's model: add_sub or simple_cnn (add_sub)"
    )
    parser.add_argument(
        "--idle", type=float, default=5.0,
        help="--sampling-ab: seconds each relay is read with no traffic, by thread (5; 0: not)",
    )  # fmt: skip
    parser.add_argument(
        "--sizes", nargs="+", metavar="SIZE",
        help="request and response sizes beside socat, e.g. 16 48K 2M (bench/size_floor.py)",
    )  # fmt: skip
    parser.add_argument(
        "--protocol", choices=("grpc", "http"), default="grpc",
        help="--sizes through the gRPC relay or the HTTP relay (--http-listen); http: --sizes 16",
    )  # fmt: skip
    parser.add_argument(
        "--socat-buffer", type=int, default=256000,
        help="--sizes: socat's block size (-b), 256000 = the relay's uvloop receive buffer; "
        "0: socat's default 8192",
    )  # fmt: skip
    parser.add_argument(
        "--base-tree", type=Path, default=None,
        help="--sizes: also relays running another checkout's code (PYTHONPATH; its C "
        "extensions built or copied in), alternated in the same windows: an A/B of two versions",
    )  # fmt: skip
    parser.add_argument(
        "--split-calls", type=int, default=50,
        help="calls scanned in-process for the split-frame cost at sizes >= 1 MiB (50; 0: not)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.backend and not args.triton_pid:
        parser.error("--backend needs --triton-pid (the bench reads Triton's CPU time)")

    with tempfile.TemporaryDirectory(prefix="xsp-bench-") as tmp:
        server = None
        if args.backend:
            backend, triton_pid = args.backend, args.triton_pid
        else:
            from tests.harness.triton.model_repo import build_model_repository
            from tests.harness.triton.server import TritonServer

            repo = build_model_repository(Path(tmp) / "models")
            server = TritonServer(model_repository=repo, log_path=Path(tmp) / "triton.log")
            server.start()
            backend, triton_pid = server.grpc_address, server.pid
        if args.sizes or args.protocol == "http":
            if server is None:
                parser.error("--sizes / --protocol http start their own Triton (its repository)")
            try:
                return sized_floor(args, server, Path(tmp))
            finally:
                server.stop()
        if args.sampling_ab:
            if server is None:
                parser.error("--sampling-ab starts its own Triton (its model repository)")
            try:
                sampling_ab(backend, triton_pid, server.model_repository, Path(tmp), args)
            finally:
                server.stop()
            return 0
        relay, relay_address = start_relay(backend)
        try:
            print(f"Triton {backend} (pid {triton_pid}); relay {relay_address} (pid {relay.pid});")
            print(f"{args.duration:.0f} s per measurement, CPU from /proc/<pid>/stat")
            for concurrency in args.concurrency:
                direct = run_load(
                    backend, concurrency, args.duration, args.warmup, triton_pid, None
                )
                relayed = run_load(
                    relay_address, concurrency, args.duration, args.warmup, triton_pid, relay.pid
                )
                report(concurrency, direct, relayed)
                if args.streaming:
                    streams = [
                        run_load(
                            address, concurrency, args.duration, args.warmup, triton_pid, pid,
                            client=_stream_client,
                        )
                        for address, pid in ((backend, None), (relay_address, relay.pid))
                    ]  # fmt: skip
                    report_streaming(concurrency, relayed, *streams)
                started = start_bare_relay(backend)
                if started is None:
                    print("  bare TCP relay: socat not on PATH, skipped")
                    continue
                bare, bare_address = started
                clients = [_client, _stream_client] if args.streaming else [_client]
                try:
                    floors = [
                        run_load(
                            bare_address, concurrency, args.duration, args.warmup, triton_pid,
                            bare.pid, relay_cpu=forking_relay_cpu_seconds, client=client,
                        )
                        for client in clients
                    ]  # fmt: skip
                finally:
                    bare.kill()
                    bare.wait(10)
                report_bare(concurrency, direct, floors[0], relayed)
                if args.streaming:
                    report_bare(concurrency, streams[0], floors[1], streams[1], unit="inf")
                    report_streaming_floor((floors[0], relayed), (floors[1], streams[1]))
            if server is not None and server.environment is not None:
                perf_analyzer_report(
                    backend, relay_address, args.concurrency, args.duration,
                    server.environment.library_dir,
                )  # fmt: skip
        finally:
            relay.send_signal(signal.SIGTERM)
            relay.wait(10)
            if server is not None:
                server.stop()
    return 0


def sized_floor(args: argparse.Namespace, server: object, tmp: Path) -> int:
    """`--sizes` / `--protocol http`: bench/size_floor.py's measures."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import size_floor

    from tests.harness.triton.server import TritonServer

    assert isinstance(server, TritonServer)
    args.sizes = [size_floor.parse_size(s) for s in args.sizes or ["16"]]
    size_floor.measure(
        args, server.grpc_address, server.http_address, server.pid, server.model_repository, tmp
    )
    large = [s for s in args.sizes if s >= 1 << 20]
    if args.protocol == "grpc" and large and args.split_calls > 0:
        size_floor.split_frame_cost(max(large), args.split_calls, [65536, 262144], repeat=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
