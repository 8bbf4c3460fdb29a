"""Soak: attack a real `xsp-sidecar serve` from outside for a while, then check it came back.

One process tree on loopback: a real `tritonserver` 2.51 (from `tests.harness.triton`) in
OpenTelemetry trace mode, and `xsp-sidecar serve` in front of it with sampling, a trace
database, the OTLP receiver and the admin API on. A well-formed client calls through the
sidecar the whole time while rounds of attacks run, each bounded in count and time:

  churn       connect / infer / close, many times
  slowloris   half-sent prefaces, then FIN (half) or nothing (half)
  garbage     random bytes, HTTP/1.1, a 1 MB header, then normal calls on the same channel
  labels      forced profiles of non-existent models with large bodies and hostile names
  otlp        malformed payloads, stalled POSTs, many spans of traces that never finish
  admin       absurd sampling settings and list sizes, then the defaults restored
  restart     the backend stopped and started again
  disk        the trace database's filesystem filled (a 3 MB tmpfs), then freed

The first rounds are a warm-up: the sidecar's heap reaches its working size only after every
attack ran a few times (measured: RSS +7, +2, +2, then flat within 0.3 MB for the next rounds
after two warm-up rounds; on CI's machine +16 MB in the first round after two). So the warm-up
runs at least `--warmup-rounds` (2) and then until a round adds less than 2 % of RSS, at most
`--max-warmup-rounds` (8); an RSS still growing after that many rounds is itself a failed check
(a leak shows as growth that never levels off). The start values are read after the warm-up
settles. The sidecar runs with a fixed glibc mmap threshold (`MEASURABLE_HEAP`) so that its
RSS follows live memory rather than the heap's high-water mark. After the last round and the
same settling time, file descriptors, threads and RSS of the sidecar process and the number
of /metrics series must be within 10 % of the start, no well-formed request may have failed
(calls made while the backend was stopped on purpose do not count), the sidecar must still be
alive, and a forced profile made after the attacks must be stored.

    python bench/soak.py --duration 1800      # the full soak (docs/benchmarks.md)
    python bench/soak.py --duration 20 --settle 15   # the short version CI runs

Exit status 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from prometheus_client.metrics_core import Metric

from sidecar.admin._proto.xsp.v1 import profiler_pb2, profiler_pb2_grpc
from tests.harness.metrics_text import families, sample_sum, scrape
from tests.harness.process import free_port
from tests.harness.sidecar_process import SidecarProcess, SidecarStartError
from tests.harness.triton.model_repo import build_model_repository
from tests.harness.triton.server import TritonServer
from tests.harness.triton.tracing import traced_server

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FORCE = {"x-xsp-profile": "1"}
TOLERANCE = 0.10
# glibc raises its mmap threshold after freeing a large mmapped block, so later large buffers
# (the attacks' 1 MB headers and big bodies) come from the heap and their pages stay resident
# after they are freed: RSS then shows the heap's high-water mark, not what is live (measured:
# +29 MB in one round, then flat). A fixed threshold maps every block over 128 KiB on its own
# and unmaps it when freed, so RSS follows live memory (rounds within 3 MB). The soak's sidecar
# only; a deployed sidecar keeps glibc's default (per-chunk mmap would cost the relay).
MEASURABLE_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
WARMUP_SETTLED = 0.02  # a warm-up round that adds less RSS than this ends the warm-up


# -- the processes under test --------------------------------------------------------------
@dataclass
class Rig:
    """Triton + the sidecar, their ports and paths."""

    root: Path
    triton: TritonServer
    repo: Path
    db_dir: Path
    tmpfs: bool
    listen: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    otlp_port: int = 0
    sidecar: SidecarProcess | None = None
    backend_down: list[tuple[float, float]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listen}"

    @property
    def log_path(self) -> Path:
        return self.root / "sidecar.log"

    def start_sidecar(self) -> None:
        args = [
            "--model-repository", str(self.repo), "--db", str(self.db_dir / "traces.db"),
            "--otlp-port", str(self.otlp_port), "--admin",
            "--admin-listen", f"127.0.0.1:{self.admin_port}",
            "--max-models", "6", "--sample-rate", "0.01", "--duty-cycle", "0.2",
            "--iterations", "3", "--warmup", "1", "--grace-period", "5",
            "--retention-max-mb", "1",  # the store itself stays well inside the 3 MB tmpfs
        ]  # fmt: skip
        self.sidecar = SidecarProcess(
            self.triton.grpc_address, self.log_path, args, listen_port=self.listen,
            metrics_port=self.metrics_port, grpc_port=self.grpc_port, extra_env=MEASURABLE_HEAP,
        )  # fmt: skip
        try:
            self.sidecar.start()
        except SidecarStartError as exc:
            raise SystemExit(str(exc)) from None

    def pid(self) -> int:
        assert self.sidecar is not None
        return self.sidecar.pid

    def alive(self) -> bool:
        return self.sidecar is not None and self.sidecar.alive()


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "3m") -> Iterator[bool]:
    """Mount a tmpfs of `size` at `path` when this machine allows it (True), else a plain dir."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


# -- what is measured ----------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    fds: int
    threads: int
    rss_mb: float
    series: int
    models: int
    model_labels: tuple[str, ...] = field(default=(), repr=False)

    def row(self) -> list[str]:
        return [
            str(self.fds), str(self.threads), f"{self.rss_mb:.1f}", str(self.series),
            str(self.models),
        ]  # fmt: skip


def metric_families(port: int) -> list[Metric]:
    return families(scrape(f"http://127.0.0.1:{port}/metrics"))


def usage(rig: Rig) -> Usage:
    pid = rig.pid()
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    series, models = 0, set()
    for family in metric_families(rig.metrics_port):
        for sample in family.samples:
            series += 1
            if "model" in sample.labels:
                models.add(sample.labels["model"])
    return Usage(
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(fields["Threads"]),
        rss_mb=int(fields["VmRSS"].split()[0]) / 1024,
        series=series,
        models=len(models),
        model_labels=tuple(sorted(models)),
    )


def metric_sum(rig: Rig, name: str, **labels: str) -> float:
    return sample_sum(scrape(f"http://127.0.0.1:{rig.metrics_port}/metrics"), name, **labels)


def sampling_summary(rig: Rig) -> dict[str, float]:
    """simple_cnn's sampling decisions, profile outcomes and drops (to explain a failure)."""
    wanted = {
        "xsp_sampling_decisions_total": "decision",
        "xsp_profiles_total": "outcome",
        "xsp_samples_dropped_total": "reason",
    }
    summary: dict[str, float] = {}
    for family in metric_families(rig.metrics_port):
        for sample in family.samples:
            label = wanted.get(sample.name)
            if label and sample.labels.get("model") == "simple_cnn":
                summary[f"{sample.name}{{{sample.labels.get(label)}}}"] = sample.value
    return summary


# -- the well-formed client ----------------------------------------------------------------
def cnn_input(batch: int = 1) -> grpcclient.InferInput:
    x = grpcclient.InferInput("input", [batch, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.random.default_rng(batch).random((batch, 3, 32, 32), np.float32))
    return x


class GoodClient(threading.Thread):
    """Sends well-formed ModelInfer calls through the sidecar until stopped; keeps failures."""

    def __init__(self, rig: Rig) -> None:
        super().__init__(daemon=True)
        self.rig = rig
        self.ok = 0
        self.failures: list[tuple[float, str]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        client = grpcclient.InferenceServerClient(self.rig.address)
        inputs = [cnn_input()]
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                client.infer("simple_cnn", inputs, client_timeout=10)
                self.ok += 1
            except Exception as exc:  # every failure is recorded
                self.failures.append((started, str(exc).splitlines()[0][:200]))
                client.close()
                client = grpcclient.InferenceServerClient(self.rig.address)
            self.stopping.wait(0.02)
        client.close()

    def unexpected_failures(self) -> list[tuple[float, str]]:
        """Failures outside the windows in which the backend was stopped on purpose."""
        windows = self.rig.backend_down
        return [
            (t, why)
            for t, why in self.failures
            if not any(start - 0.5 <= t <= end + 1.0 for start, end in windows)
        ]


# -- the attacks ---------------------------------------------------------------------------
def raw_socket(rig: Rig) -> socket.socket:
    return socket.create_connection(("127.0.0.1", rig.listen), timeout=5)


def attack_churn(rig: Rig, rounds: int = 60) -> None:
    for _ in range(rounds):
        client = grpcclient.InferenceServerClient(rig.address)
        client.infer("simple_cnn", [cnn_input()], client_timeout=10)
        client.close()


def attack_slowloris(rig: Rig, count: int = 60) -> None:
    socks = []
    for i in range(count):
        sock = raw_socket(rig)
        sock.sendall(PREFACE[: 5 + i % 15])
        socks.append(sock)
    time.sleep(1.0)
    for i, sock in enumerate(socks):
        with contextlib.suppress(OSError):
            if i % 2 == 0:
                sock.shutdown(socket.SHUT_WR)  # FIN, then wait for the relay to close
                sock.settimeout(2.0)
                with contextlib.suppress(OSError):
                    sock.recv(65536)
        sock.close()


def attack_garbage(rig: Rig, count: int = 20) -> None:
    rng = random.Random(7)
    payloads = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        PREFACE + bytes(rng.randrange(256) for _ in range(4096)),
        bytes(rng.randrange(256) for _ in range(8192)),
        PREFACE + b"\x00\x00\x06\x04\x00\x00\x00\x00\x00" + b"\x00\x04\xff\xff\xff\xff",
    ]
    for i in range(count):
        with contextlib.suppress(OSError), raw_socket(rig) as sock:
            sock.sendall(payloads[i % len(payloads)])
            sock.settimeout(0.5)
            with contextlib.suppress(OSError):
                sock.recv(65536)
    # A 1 MB header the backend refuses, then normal calls on the same connection.
    client = grpcclient.InferenceServerClient(rig.address)
    with contextlib.suppress(Exception):
        client.infer("simple_cnn", [cnn_input()], headers={"x-big": "a" * (1 << 20)})
    for _ in range(5):
        client.infer("simple_cnn", [cnn_input()], headers=FORCE, client_timeout=10)
    client.close()


def attack_labels(rig: Rig, count: int = 12) -> None:
    client = grpcclient.InferenceServerClient(rig.address)
    big = grpcclient.InferInput("input", [1, 3, 1024, 1024], "FP32")
    big.set_data_from_numpy(np.zeros((1, 3, 1024, 1024), np.float32))  # 12 MB
    names = [f"no-such-model-{random.randrange(1 << 30)}" for _ in range(count - 2)]
    names += ["x" * 10_000, "nul\x00byte"]
    for name in names:
        with contextlib.suppress(Exception):
            client.infer(name, [big], headers=FORCE, client_timeout=10)
    client.close()


def otlp_post(rig: Rig, body: bytes, content_type: str = "application/json") -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{rig.otlp_port}/v1/traces",
        data=body,
        headers={"Content-Type": content_type},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def unfinished_trace(spans: int) -> bytes:
    """`spans` child spans of one trace whose root never arrives."""
    trace_id = os.urandom(16).hex()
    now = time.time_ns()
    items = [
        {
            "traceId": trace_id,
            "spanId": os.urandom(8).hex(),
            "parentSpanId": os.urandom(8).hex(),
            "name": "compute",
            "kind": 2,
            "startTimeUnixNano": str(now),
            "endTimeUnixNano": str(now + 1000),
        }
        for _ in range(spans)
    ]
    payload = {"resourceSpans": [{"scopeSpans": [{"spans": items}]}]}
    return json.dumps(payload).encode()


def attack_otlp(rig: Rig, stalled: int = 30) -> None:
    bad = [
        b"{not json",
        b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"00","spanId":"00",'
        b'"startTimeUnixNano":"1e999","attributes":[{"key":"k","value":{"doubleValue":"abc"}}]}]}]}]}',
        b"[" * 100_000 + b"]" * 100_000,
        b"\xff\xfe" * 100,
    ]
    for body in bad:
        otlp_post(rig, body)
    otlp_post(rig, b"x", content_type="application/x-protobuf")
    for _ in range(3):
        otlp_post(rig, unfinished_trace(20_000))
    socks = []
    for _ in range(stalled):
        with contextlib.suppress(OSError):
            sock = socket.create_connection(("127.0.0.1", rig.otlp_port), timeout=5)
            sock.sendall(
                b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{"
            )
            socks.append(sock)
    time.sleep(1.0)
    for sock in socks:
        sock.close()


def attack_admin(rig: Rig) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{rig.admin_port}") as channel:
        stub = profiler_pb2_grpc.ProfilerStub(channel)
        before = stub.GetSampling(profiler_pb2.GetSamplingRequest(), timeout=5)
        abuse = [
            profiler_pb2.UpdateSamplingRequest(duty_cycle=5e-324),
            profiler_pb2.UpdateSamplingRequest(budget_per_minute=math.nan),
            profiler_pb2.UpdateSamplingRequest(rate=2.0),
            profiler_pb2.UpdateSamplingRequest(duty_cycle=math.inf),
            profiler_pb2.UpdateSamplingRequest(model_rates={"m" * 5000: 0.5}),
        ]
        for update in abuse:
            with contextlib.suppress(grpc.RpcError):
                stub.UpdateSampling(update, timeout=5)
        for limit in (-1, 2**31 - 1, 0):
            with contextlib.suppress(grpc.RpcError):
                stub.ListTraces(profiler_pb2.ListTracesRequest(limit=limit), timeout=10)
        with contextlib.suppress(grpc.RpcError):
            stub.TriggerProfile(profiler_pb2.TriggerProfileRequest(model="../../etc"), timeout=5)
        stub.UpdateSampling(
            profiler_pb2.UpdateSamplingRequest(
                rate=before.rate,
                budget_per_minute=before.budget_per_minute,
                duty_cycle=before.duty_cycle,
                enabled=True,
            ),
            timeout=5,
        )


def attack_restart(rig: Rig) -> None:
    start = time.monotonic()
    rig.triton.stop()
    client = grpcclient.InferenceServerClient(rig.address)
    for _ in range(20):
        with contextlib.suppress(Exception):
            client.infer("simple_cnn", [cnn_input()], client_timeout=5)
    client.close()
    rig.triton.start()
    rig.backend_down.append((start, time.monotonic()))


def attack_disk(rig: Rig) -> None:
    if not rig.tmpfs:
        return
    filler = rig.db_dir / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as out:
        while True:
            out.write(b"\0" * (64 << 10))
            out.flush()
    client = grpcclient.InferenceServerClient(rig.address)
    for _ in range(10):
        client.infer("simple_cnn", [cnn_input()], headers=FORCE, client_timeout=10)
        time.sleep(0.3)
    client.close()
    time.sleep(2.0)
    filler.unlink()


ATTACKS: list[tuple[str, Callable[[Rig], None]]] = [
    ("churn", attack_churn),
    ("slowloris", attack_slowloris),
    ("garbage", attack_garbage),
    ("labels", attack_labels),
    ("otlp", attack_otlp),
    ("admin", attack_admin),
    ("restart", attack_restart),
    ("disk", attack_disk),
]


# -- the run -------------------------------------------------------------------------------
def run_round(
    rig: Rig, errors: dict[str, int], attacks: list[tuple[str, Callable[[Rig], None]]]
) -> None:
    for name, attack in attacks:
        try:
            attack(rig)
        except Exception as exc:  # an attack that breaks is reported
            errors[name] = errors.get(name, 0) + 1
            print(f"    {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")


def warm_up(
    rig: Rig,
    errors: dict[str, int],
    attacks: list[tuple[str, Callable[[Rig], None]]],
    least: int,
    most: int,
) -> bool:
    """Run warm-up rounds until a round adds < 2 % of RSS (at least `least`, at most `most`).

    Returns whether RSS levelled off; a heap that still grows after `most` rounds is a leak.
    """
    before = usage(rig).rss_mb
    for done in range(1, max(least, most) + 1):
        run_round(rig, errors, attacks)
        after = usage(rig).rss_mb
        print(f"    warm-up round {done}: RSS {before:.1f} -> {after:.1f} MB", flush=True)
        if done >= least and after - before < before * WARMUP_SETTLED:
            return True
        before = after
    return False


def forced_profile_stored(rig: Rig, timeout: float = 60.0) -> bool:
    db = rig.db_dir / "traces.db"

    def traces() -> int:
        with (
            contextlib.suppress(sqlite3.Error),
            contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as con,
        ):
            return int(con.execute("SELECT count(*) FROM traces WHERE status='ok'").fetchone()[0])
        return -1

    before = traces()
    client = grpcclient.InferenceServerClient(rig.address)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            client.infer("simple_cnn", [cnn_input()], headers=FORCE, client_timeout=10)
            if traces() > before:
                return True
            time.sleep(1.0)
    finally:
        client.close()
    return False


def within(start: float, end: float) -> bool:
    return end <= start * (1 + TOLERANCE) + 1  # +1: one fd/thread/series on small counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds (default 1800)")
    parser.add_argument(
        "--settle", type=float, default=25.0, help="seconds of quiet before reading (default 25)"
    )
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=2,
        help="warm-up rounds at least, before the start values (default 2)",
    )
    parser.add_argument(
        "--max-warmup-rounds",
        type=int,
        default=8,
        help="warm-up rounds at most, while RSS still grows by 2 %% or more a round (default 8)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--attacks",
        default=",".join(name for name, _ in ATTACKS),
        help="comma-separated attacks to run each round (default: all)",
    )
    args = parser.parse_args(argv)
    chosen = [a for a in args.attacks.split(",") if a]
    unknown = sorted(set(chosen) - {name for name, _ in ATTACKS})
    if unknown:
        parser.error(f"unknown attacks {unknown}; choose from {[n for n, _ in ATTACKS]}")
    attacks = [(name, fn) for name, fn in ATTACKS if name in chosen]

    root = Path(tempfile.mkdtemp(prefix="xsp-soak-"))
    repo = build_model_repository(root / "models")
    otlp_port = free_port()
    triton = traced_server(
        repo, root / "tritonserver.log", f"http://127.0.0.1:{otlp_port}/v1/traces", 200
    )
    with small_filesystem(root / "db") as tmpfs, triton:
        rig = Rig(root, triton, repo, root / "db", tmpfs, otlp_port=otlp_port)
        if not tmpfs:
            print("note: cannot mount a tmpfs here; the full-disk attack is skipped")
        rig.start_sidecar()
        good = GoodClient(rig)
        good.start()
        errors: dict[str, int] = {}
        print(f"==> warm-up (work dir {root})")
        warmup_settled = warm_up(rig, errors, attacks, args.warmup_rounds, args.max_warmup_rounds)
        time.sleep(args.settle)
        start = usage(rig)
        print(f"==> start: {start}")
        began = time.monotonic()
        rounds = 0
        while time.monotonic() - began < args.duration:
            rounds += 1
            run_round(rig, errors, attacks)
            elapsed = time.monotonic() - began
            print(f"    round {rounds} done at {elapsed:.0f} s: {usage(rig)}", flush=True)
        print(f"==> {rounds} rounds in {time.monotonic() - began:.0f} s; settling {args.settle} s")
        time.sleep(args.settle)
        end = usage(rig)
        profile_ok = forced_profile_stored(rig)
        if not profile_ok:
            print(f"  sampling after the attacks: {sampling_summary(rig)}")
            sizes = {p.name: p.stat().st_size for p in rig.db_dir.iterdir()}
            print(f"  trace store files (bytes): {sizes}")
        good.stopping.set()
        good.join(15)
        unexpected = good.unexpected_failures()
        alive = rig.alive()
        unobserved = metric_sum(rig, "xsp_observation_failures_total")
        log_bytes = rig.log_path.stat().st_size
        tracebacks = rig.log_path.read_text(errors="replace").count("Traceback")
        if rig.sidecar is not None:
            rig.sidecar.stop()

    header = ["", "fds", "threads", "RSS MB", "series", "models"]
    print("\n" + "".join(f"{h:>10}" for h in header))
    for label, row in (("start", start.row()), ("end", end.row())):
        print(f"{label:>10}" + "".join(f"{v:>10}" for v in row))
    checks = {
        "fds within 10%": within(start.fds, end.fds),
        "threads within 10%": within(start.threads, end.threads),
        "RSS levelled off during the warm-up": warmup_settled,
        "RSS within 10%": end.rss_mb <= start.rss_mb * (1 + TOLERANCE),
        "series within 10%": within(start.series, end.series),
        "model labels within the cap (6 + _other + _unknown)": end.models <= 8,
        "no failed well-formed request": not unexpected,
        "sidecar alive": alive,
        "forced profile stored after the attacks": profile_ok,
    }
    print(
        f"\nwell-formed calls: {good.ok} ok, {len(good.failures)} failed "
        f"({len(unexpected)} outside backend restarts); rounds: {rounds}; "
        f"observation failures counted: {unobserved:.0f}; sidecar log: {log_bytes / 1e6:.2f} MB, "
        f"{tracebacks} tracebacks; attack errors: {errors or 'none'}"
    )
    print(f"model labels at the end: {', '.join(repr(m[:40]) for m in end.model_labels)}")
    for when, why in unexpected[:5]:
        print(f"  failed at {when - began:+.1f} s: {why}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if args.keep:
        print(f"work directory kept: {root}")
    else:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
