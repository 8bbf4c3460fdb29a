"""The demo: a local Triton, the sidecar in front, traffic, sampled profiles and a report.

Everything runs on this machine on free ports and ends by itself; the results stay in the
output folder (trace database, report, metrics, logs).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm

from sidecar.localtriton.model_repo import build_model_repository
from sidecar.localtriton.server import free_port
from sidecar.localtriton.sidecar_process import SidecarProcess
from sidecar.localtriton.tracing import traced_server
from sidecar.metrics_text import sample_sum, scrape, sums_by

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]
DECISIONS = "xsp_sampling_decisions_total"


@dataclass(frozen=True)
class DemoOptions:
    out: Path
    requests: int = 300
    sample_rate: float = 0.02
    forced: int = 3
    report_format: str = "text"


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def _cnn_input(batch: int, rng: np.random.Generator) -> grpcclient.InferInput:
    x = grpcclient.InferInput("input", [batch, 3, 32, 32], "FP32")
    x.set_data_from_numpy(rng.random((batch, 3, 32, 32), dtype=np.float32))
    return x


def send_traffic(address: str, options: DemoOptions) -> dict[str, int]:
    """A burst of simple_cnn (batch 1-4) and add_sub calls through the sidecar."""
    client = grpcclient.InferenceServerClient(address)
    rng = np.random.default_rng(0)
    counts = {"ok": 0, "error": 0}
    for i in tqdm(range(options.requests), desc="requests through the sidecar", unit="req"):
        try:
            if i % 3 == 2:
                a = rng.random(16, dtype=np.float32)
                inputs = [
                    grpcclient.InferInput("INPUT0", [16], "FP32"),
                    grpcclient.InferInput("INPUT1", [16], "FP32"),
                ]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(a)
                client.infer("add_sub", inputs)
            else:
                client.infer("simple_cnn", [_cnn_input(1 + i % 4, rng)])
            counts["ok"] += 1
        except grpcclient.InferenceServerException:
            counts["error"] += 1
    client.close()
    return counts


@dataclass
class ForcedResult:
    """What the forced requests took: `attempts` calls for `profiles` profiles."""

    profiles: int = 0
    attempts: int = 0
    turned_away: dict[str, int] = field(default_factory=dict)  # decision -> calls


def send_forced(address: str, metrics_url: str, db: Path, count: int) -> ForcedResult:
    """`count` simple_cnn calls with `x-xsp-profile: 1`, one profile at a time: a forced call
    still respects the budget and the worker's duty cycle, so a call that was turned away
    (counted, with the decision that turned it away) is sent again until one is sampled."""
    client = grpcclient.InferenceServerClient(address)
    rng = np.random.default_rng(1)
    result = ForcedResult()
    for k in range(count):
        before = count_traces(db)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            decisions = sums_by(scrape(metrics_url), DECISIONS, "decision")
            client.infer("simple_cnn", [_cnn_input(1 + k % 4, rng)], headers={"x-xsp-profile": "1"})
            result.attempts += 1
            after = sums_by(scrape(metrics_url), DECISIONS, "decision")
            if after.get("sampled", 0.0) > decisions.get("sampled", 0.0):
                result.profiles += 1
                break
            why = next((d for d in after if after[d] > decisions.get(d, 0.0)), "unknown")
            result.turned_away[why] = result.turned_away.get(why, 0) + 1
            time.sleep(0.5)  # the duty-cycle gate is closed; try again
        wait_for_traces(db, before, 1, timeout=60, desc=f"forced profile {k + 1}/{count}")
    client.close()
    return result


def count_traces(db: Path) -> int:
    import sqlite3

    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        try:
            row = con.execute("SELECT count(*) FROM traces WHERE sample_reason != 'cli'")
            return int(row.fetchone()[0])
        except sqlite3.Error:
            return 0


def wait_for_traces(
    db: Path, before: int, want: int, timeout: float = 120.0, desc: str = "profiles"
) -> int:
    """Poll the trace store until `want` traces more than `before` exist (or time runs out);
    the bar counts this wait's traces, not the store's."""
    deadline = time.monotonic() + timeout
    new = 0
    fmt = "{desc}: {n_fmt}/{total_fmt} trace(s) stored [{elapsed}]"
    with tqdm(total=want, desc=desc, bar_format=fmt) as bar:
        while time.monotonic() < deadline:
            new = count_traces(db) - before
            bar.n = min(new, want)
            bar.refresh()
            if new >= want:
                break
            time.sleep(0.3)
    return new


def failed_profiles(db: Path) -> dict[str, int]:
    """Error message -> number of profiles stored with status error."""
    import sqlite3

    if not db.exists():
        return {}
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        try:
            rows = con.execute(
                "SELECT model || ': ' || COALESCE(error, status), COUNT(*) FROM traces "
                "WHERE status != 'ok' GROUP BY 1"
            ).fetchall()
        except sqlite3.Error:
            return {}
    return {str(k): int(n) for k, n in rows}


def account(
    options: DemoOptions, counts: dict[str, int], forced: ForcedResult, metrics_text: str, db: Path
) -> list[str]:
    """Console lines that add up: what was sent, what the sidecar counted, what it sampled,
    skipped and profiled, and why profiles failed."""
    sent = options.requests + forced.attempts
    counted = sample_sum(metrics_text, "xsp_requests_total")
    lines = [
        f"requests: {options.requests} traffic + {forced.attempts} forced calls "
        f"(for {forced.profiles} forced profile(s)) = {sent} sent; xsp_requests_total "
        f"counted {counted:.0f}" + ("" if round(counted) == sent else " (they differ!)"),
    ]
    if forced.turned_away:
        why = ", ".join(f"{n} by {d}" for d, n in sorted(forced.turned_away.items()))
        lines.append(f"forced calls turned away and sent again: {why}")
    decisions = sums_by(metrics_text, DECISIONS, "decision")
    lines.append(
        "sampling decisions: "
        + ", ".join(f"{d} {n:.0f}" for d, n in sorted(decisions.items(), key=lambda kv: -kv[1]))
    )
    outcomes = sums_by(metrics_text, "xsp_profiles_total", "outcome")
    lines.append(
        "profiles: " + (", ".join(f"{o} {n:.0f}" for o, n in sorted(outcomes.items())) or "none")
    )
    for reason, n in sorted(failed_profiles(db).items()):
        lines.append(f"  failed ({n}x): {reason[:200]}")
    if counts["error"]:
        lines.append(f"traffic errors (the client saw them): {counts['error']}")
    return lines


def interesting_metrics(text: str) -> list[str]:
    keep = (
        "xsp_requests_total",
        "xsp_sampling_decisions_total",
        "xsp_profiles_total",
        "xsp_profiled_latency_seconds",
        "xsp_profiling_overhead_ratio",
        "xsp_backend_phase_duration_seconds_count",
        "xsp_samples_dropped_total",
    )
    return [line for line in text.splitlines() if line.startswith(keep)]


def run_demo(options: DemoOptions) -> int:
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    db = out / "traces.db"
    for stale in (db, db.with_name("traces.db-wal"), db.with_name("traces.db-shm")):
        stale.unlink(missing_ok=True)
    otlp_port, admin_port = free_port(), free_port()

    say("building the sample model repository (add_sub, simple_cnn, sleep)")
    repo = build_model_repository(out / "models")
    say("starting Triton (OpenTelemetry tracing to the sidecar's OTLP receiver)")
    otlp_url = f"http://127.0.0.1:{otlp_port}/v1/traces"
    triton = traced_server(repo, out / "tritonserver.log", otlp_url, 200)
    with triton:
        say(f"Triton ready on {triton.grpc_address}; starting the sidecar in front of it")
        args = [
            "--model-repository", str(repo), "--db", str(db),
            "--otlp-port", str(otlp_port), "--sample-rate", str(options.sample_rate),
            "--sample-budget", "60", "--duty-cycle", "0.5", "--levels", "M,L",
            "--admin", "--admin-listen", f"127.0.0.1:{admin_port}",
        ]  # fmt: skip
        sidecar = SidecarProcess(triton.grpc_address, out / "sidecar.log", args, keep_xsp_env=True)
        with sidecar:
            relay = sidecar.address
            say(f"sidecar relaying on {relay}; metrics on :{sidecar.metrics_port}/metrics")
            counts = send_traffic(relay, options)
            say(f"sent {options.requests} requests: {counts['ok']} ok, {counts['error']} errors")
            say(f"sending {options.forced} requests with x-xsp-profile: 1 (forced samples)")
            forced = send_forced(relay, sidecar.metrics_url, db, options.forced)
            time.sleep(1.5)  # let Triton's span export and the writer catch up
            stored = count_traces(db)
            metrics_text = sidecar.metrics()
            (out / "metrics.txt").write_text(metrics_text)
            say("what the sidecar recorded (selected /metrics lines):")
            for line in interesting_metrics(metrics_text):
                print(f"    {line}")
            say("adding it up:")
            for line in account(options, counts, forced, metrics_text, db):
                print(f"    {line}")
    say(f"{stored} sampled request(s) profiled and stored in {db}")
    report = [sys.executable, str(REPO_ROOT / "analysis" / "report.py")]
    say("report on the sampled live requests (analysis/report.py):")
    subprocess.run([*report, str(db), "--format", options.report_format], check=True)
    subprocess.run(
        [*report, str(db), "--format", "html", "--out", str(out / "report")],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    # The sweep goes to its own database: replays of live samples run in the low-priority
    # worker with one thread, so mixing them into one batch-size curve would mislead.
    sweep = out / "sweep.db"
    for stale in (sweep, sweep.with_name("sweep.db-wal"), sweep.with_name("sweep.db-shm")):
        stale.unlink(missing_ok=True)
    say("a standalone batch-size sweep of simple_cnn (xsp-sidecar profile):")
    subprocess.run(
        [sys.executable, "-m", "sidecar", "profile", str(repo / "simple_cnn" / "1" / "model.onnx"),
         "--batch-size", "1,2,4,8", "--levels", "M,L", "--iterations", "20", "--warmup", "5",
         "--db", str(sweep)],
        check=True,
    )  # fmt: skip
    subprocess.run(
        [*report, str(sweep), "--only", "A1,A15", "--format", options.report_format], check=True
    )
    subprocess.run(
        [*report, str(sweep), "--format", "html", "--out", str(out / "sweep-report")],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    say("done. Results:")
    print(f"    sampled traces : {db}  (HTML report in {out / 'report'})")
    print(f"    batch sweep    : {sweep}  (HTML report in {out / 'sweep-report'})")
    print(f"    metrics scrape : {out / 'metrics.txt'}")
    print(f"    logs           : {out / 'sidecar.log'}, {out / 'tritonserver.log'}")
    print(f"    try            : python analysis/report.py {db} --format markdown")
    return 0
