"""Where the relay stands against a byte copier's floor: the same load through four relays.

The relay (`xsp-sidecar serve`), the same relay with its observation switched off (each
`FrameScanner.observe` a no-op: bytes forwarded by its Python callbacks, nothing scanned), a bare
uvloop relay (the relay's `asyncio.Protocol` structure, no parsing, no metrics) and socat (C,
a process per connection), in front of one real Triton, measured in alternating windows of
closed-loop unary ModelInfer load (`proxy_overhead.py`'s clients). Per call, for each: CPU
(/proc/<pid>/stat), read and write system calls (/proc/<pid>/io `syscr`, `syscw`), voluntary
and involuntary context switches (/proc/<pid>/task/*/status), throughput and p50 added to
direct. With `--tree DIR` a second relay runs from another checkout (its `PYTHONPATH`), for an
A/B in the same windows.

    python bench/relay_floor.py --duration 5 --rounds 4 --concurrency 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

from proxy_overhead import (
    await_listening,
    cpu_seconds,
    drive_clients,
    process_tree,
    start_bare_relay,
)

from tests.harness.process import free_port

COLUMNS = ("req/s", "p50+ms", "CPU us", "reads", "writes", "vol cs", "invol cs")


def counters(pids: list[int]) -> list[float]:
    """CPU seconds, read and write syscalls, voluntary and involuntary context switches."""
    out = [0.0] * 5
    for pid in pids:
        try:
            out[0] += cpu_seconds(pid)
            with open(f"/proc/{pid}/io") as fh:
                io = dict(line.split(": ") for line in fh.read().splitlines())
            out[1] += int(io["syscr"])
            out[2] += int(io["syscw"])
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/status") as fh:
                    for line in fh:
                        if line.startswith("voluntary_ctxt_switches"):
                            out[3] += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            out[4] += int(line.split()[1])
        except OSError:  # a process or thread ended meanwhile
            continue
    return out


def window(
    address: str, relay: Callable[[], list[int]], concurrency: int, seconds: float
) -> list[float]:
    """One load window: throughput, p50 (ms) and each of `counters` per call of the processes
    `relay()` names once the clients are connected (socat forks one per connection)."""

    def on_ready() -> Callable[[], tuple[list[float], list[float]]]:
        pids = relay()
        before = counters(pids)
        return lambda: (before, counters(pids))

    latencies, elapsed, (before, after) = drive_clients(
        address, concurrency, seconds, 1.0, on_ready
    )
    n = len(latencies)
    per_call = [(b - a) / n for a, b in zip(before, after, strict=True)]
    per_call[0] *= 1e6
    return [n / elapsed, statistics.median(latencies) * 1e3, *per_call]


def start_sidecar(backend: str, tree: str, *, unobserved: bool = False) -> tuple[
    subprocess.Popen[bytes], str
]:  # fmt: skip
    port = free_port()
    prefix = [sys.executable, __file__, "--serve-unobserved"] if unobserved else [
        sys.executable, "-m", "sidecar"
    ]  # fmt: skip
    cmd = [
        *prefix, "--log-level", "WARNING", "serve", "--backend", backend,
        "--listen", f"127.0.0.1:{port}", "--metrics-port", str(free_port()),
        "--grpc-port", str(free_port()), "--grace-period", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=tree))
    return await_listening(proc, port, f"the relay ({tree})")


def serve_unobserved(argv: list[str]) -> int:
    """`xsp-sidecar serve` with `FrameScanner.observe` a no-op, its chunks relayed by the
    Python `data_received` callbacks (no C pump: that would walk them)."""
    from sidecar.cli import main
    from sidecar.proxy import relay
    from sidecar.proxy.frames import FrameScanner

    FrameScanner.observe = lambda self, data: None  # type: ignore[method-assign]
    relay.native_pump = None
    return main(argv)


def bare_relay(port: int, host: str, backend_port: int) -> None:
    """A uvloop relay of `asyncio.Protocol`s: each chunk written to the other side, no more."""
    import uvloop

    def nodelay(transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    class Backend(asyncio.Protocol):
        def __init__(self, client: Client) -> None:
            self.client = client

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            nodelay(transport)

        def data_received(self, data: bytes) -> None:
            if not self.client.transport.is_closing():  # else the client is gone
                self.client.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.client.transport.close()

    class Client(asyncio.Protocol):
        transport: asyncio.Transport
        backend: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            self.pending: list[bytes] = []
            nodelay(transport)
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            backend, _ = await loop.create_connection(lambda: Backend(self), host, backend_port)
            self.backend = backend
            backend.writelines(self.pending)

        def data_received(self, data: bytes) -> None:
            if self.backend is None:
                self.pending.append(data)
            elif not self.backend.is_closing():
                self.backend.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.backend is not None:
                self.backend.close()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Client, "127.0.0.1", port, reuse_address=True)
        await server.serve_forever()

    uvloop.run(serve())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--rounds", type=int, default=4, help="windows per relay, alternated")
    parser.add_argument("--concurrency", type=int, default=1, help="client processes")
    parser.add_argument("--tree", help="also the relay of this checkout (A/B)")
    args = parser.parse_args(argv)

    from tests.harness.triton.model_repo import build_model_repository
    from tests.harness.triton.server import TritonServer

    here = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix="xsp-floor-") as tmp:
        server = TritonServer(
            model_repository=build_model_repository(Path(tmp) / "models"),
            log_path=Path(tmp) / "triton.log",
        )
        server.start()
        backend = server.grpc_address
        host, _, backend_port = backend.rpartition(":")
        relays: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            relays["relay"] = start_sidecar(backend, here)
            if args.tree:
                relays["relay (--tree)"] = start_sidecar(backend, args.tree)
            relays["observing off"] = start_sidecar(backend, here, unobserved=True)
            port = free_port()
            bare = subprocess.Popen(
                [sys.executable, __file__, "--bare-relay", str(port), host, backend_port]
            )
            relays["bare uvloop"] = await_listening(bare, port, "the bare relay")
            socat = start_bare_relay(backend)
            if socat is not None:
                relays["socat"] = socat
            direct: list[list[float]] = []
            results: dict[str, list[list[float]]] = {name: [] for name in relays}
            for _ in range(args.rounds):
                direct.append(window(backend, list, args.concurrency, args.duration))
                for name, (proc, address) in relays.items():
                    pids = partial(process_tree, proc.pid) if name == "socat" else [proc.pid].copy
                    results[name].append(window(address, pids, args.concurrency, args.duration))
        finally:
            for proc, _ in relays.values():
                proc.kill()
                proc.wait(10)
            server.stop()
    p50 = statistics.median(w[1] for w in direct)
    print(f"concurrency {args.concurrency}, {args.rounds} windows of {args.duration:.0f} s per "
          f"relay, alternated; load average {os.getloadavg()[0]:.1f}; direct "
          f"{statistics.median(w[0] for w in direct):.0f} req/s, p50 {p50:.3f} ms")  # fmt: skip
    print(f"  {'relay':16}" + "".join(f"{c:>9}" for c in COLUMNS) + "   CPU us by window")
    for name, windows in results.items():
        medians = [statistics.median(w[i] for w in windows) for i in range(len(COLUMNS))]
        medians[1] -= p50
        row = f"{medians[0]:9.0f}{medians[1]:+9.3f}{medians[2]:9.1f}"
        row += "".join(f"{m:9.2f}" for m in medians[3:])
        print(f"  {name:16}{row}   " + " ".join(f"{w[2]:.1f}" for w in windows))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-unobserved"]:
        raise SystemExit(serve_unobserved(sys.argv[2:]))
    if sys.argv[1:2] == ["--bare-relay"]:
        bare_relay(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        raise SystemExit(0)
    raise SystemExit(main())
