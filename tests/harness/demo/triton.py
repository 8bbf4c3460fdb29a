"""The demo: a local Triton, the sidecar in front, traffic, sampled profiles and a report.

Everything runs on this machine on free ports and ends by itself; the results stay in the
output folder (trace database, report, metrics, logs).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm

from sidecar.trace.store import count_traces, failed_traces
from tests.harness import REPO_ROOT
from tests.harness.demo.rest import (
    GRPC,
    RestTraffic,
    counted,
    json_client,
    post_json,
    protocol_line,
    rest_lines,
)
from tests.harness.metrics_text import sample_sum, scrape, sums_by
from tests.harness.process import free_port
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.model_repo import build_model_repository
from tests.harness.triton.tracing import traced_server

log = logging.getLogger(__name__)
DECISIONS = "xsp_sampling_decisions_total"
PROFILES = "xsp_profiles_total"
DROPPED = "xsp_samples_dropped_total"
BUDGET_PER_MINUTE = 60
DUTY_CYCLE = 0.5
FORCEABLE: tuple[str, ...] = ("simple_cnn", "add_sub", "ens_cnn")
MODEL_FOLDER = "triton-models"  # in the output folder; the TF-Serving demo has its own


@dataclass(frozen=True)
class DemoOptions:
    out: Path
    requests: int = 300
    sample_rate: float = 0.02
    forced: int = 3
    forced_models: tuple[str, ...] = ("simple_cnn",)
    report_format: str = "text"
    rest_requests: int = 100  # sent through the sidecar's HTTP plane, beside the gRPC ones


def fresh_database(path: Path) -> Path:
    """`path` with a previous run's database (and its WAL files) removed."""
    for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        stale.unlink(missing_ok=True)
    return path


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def _inputs(model: str, i: int, rng: np.random.Generator, client: Any = grpcclient) -> list[Any]:
    """One request's inputs: `simple_cnn` at batch 1-4 (by `i`), `add_sub` of 16 floats, or
    `ens_cnn` (pre -> simple_cnn) on one image of pixel values 0-255; `client` is the
    tritonclient module whose `InferInput`s they are (`grpc`, or `http`: binary tensors)."""
    if model == "ens_cnn":
        raw = client.InferInput("RAW", [1, 3, 32, 32], "FP32")
        raw.set_data_from_numpy(rng.random((1, 3, 32, 32), dtype=np.float32) * 255)
        return [raw]
    if model == "add_sub":
        a = rng.random(16, dtype=np.float32)
        inputs = [client.InferInput(name, [16], "FP32") for name in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        return inputs
    batch = 1 + i % 4
    x = client.InferInput("input", [batch, 3, 32, 32], "FP32")
    x.set_data_from_numpy(rng.random((batch, 3, 32, 32), dtype=np.float32))
    return [x]


def add_sub_json(rng: np.random.Generator) -> dict[str, Any]:
    """An `add_sub` request in KServe v2 JSON (the tensors as JSON numbers)."""
    a = [round(float(v), 4) for v in rng.random(16)]
    tensor = {"shape": [16], "datatype": "FP32", "data": a}
    return {"inputs": [{"name": name, **tensor} for name in ("INPUT0", "INPUT1")]}


def send_traffic(address: str, options: DemoOptions) -> dict[str, int]:
    """A burst of simple_cnn (batch 1-4) and add_sub calls through the sidecar."""
    client = grpcclient.InferenceServerClient(address)
    rng = np.random.default_rng(0)
    counts = {"ok": 0, "error": 0}
    for i in tqdm(range(options.requests), desc="requests through the sidecar", unit="req"):
        model = "add_sub" if i % 3 == 2 else "simple_cnn"
        try:
            client.infer(model, _inputs(model, i, rng))
            counts["ok"] += 1
        except grpcclient.InferenceServerException:
            counts["error"] += 1
    client.close()
    return counts


def send_rest_traffic(address: str, options: DemoOptions) -> RestTraffic:
    """REST calls through the sidecar's HTTP plane at `address`: simple_cnn (batch 1-4) and
    add_sub with `tritonclient.http` (binary tensors), and every fifth an add_sub in KServe v2
    JSON (with curl)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(address)
    rng = np.random.default_rng(2)
    rest = RestTraffic()
    binary, plain = "tritonclient.http (binary tensors)", f"{json_client()} (JSON)"
    desc = "REST requests through the sidecar"
    for i in tqdm(range(options.rest_requests), desc=desc, unit="req"):
        if i % 5 == 4:
            url = f"http://{address}/v2/models/add_sub/infer"
            status, _ = post_json(url, add_sub_json(rng))
            rest.add(plain, ok=status == 200)
            continue
        model = "add_sub" if i % 3 == 2 else "simple_cnn"
        try:
            client.infer(model, _inputs(model, i, rng, httpclient))
            rest.add(binary)
        except InferenceServerException:
            rest.add(binary, ok=False)
    client.close()
    return rest


REST_FORCED = "tritonclient.http (binary tensors, x-xsp-profile: 1)"


def send_rest_forced(
    sidecar: SidecarProcess, db: Path, options: DemoOptions, rest: RestTraffic
) -> ForcedResult:
    """One REST call to simple_cnn with the forced header (tritonclient.http, binary tensors),
    sent again while turned away, its profile awaited; every attempt is counted in `rest`."""
    import tritonclient.http as httpclient

    say("sending 1 REST request with x-xsp-profile: 1 to simple_cnn (tritonclient.http)")
    client = httpclient.InferenceServerClient(sidecar.http_address)
    rng = np.random.default_rng(3)

    def infer_forced(model: str, k: int) -> None:
        inputs = _inputs(model, k, rng, httpclient)
        client.infer(model, inputs, headers={"x-xsp-profile": "1"})

    one = replace(options, forced=1, forced_models=("simple_cnn",))
    result = send_forced(infer_forced, sidecar.metrics_url, db, one, "forced REST profile")
    client.close()
    for _ in range(result.attempts):
        rest.add(REST_FORCED)
    for decision, n in sorted(result.turned_away.items()):
        rest.notes.append(
            f"  {n} forced REST call(s) sent again: turned away by {decision} "
            f"({_skip_reason(decision, options)})"
        )
    return result


def finished(metrics_text: str) -> int:
    """Sampled requests the sidecar is done with: profiled (any outcome) or dropped."""
    return round(sample_sum(metrics_text, PROFILES) + sample_sum(metrics_text, DROPPED))


def wait_for_profiles(
    metrics_url: str, before: int, want: int, desc: str, timeout: float = 120.0
) -> int:
    """Poll /metrics until `want` sampled requests more than `before` are finished (or time
    runs out); the bar counts this wait's profiles only."""
    deadline = time.monotonic() + timeout
    new = 0
    fmt = "{desc}: {n_fmt}/{total_fmt} profile(s) finished [{elapsed}]"
    with tqdm(total=want, desc=desc, bar_format=fmt) as bar:
        while time.monotonic() < deadline:
            new = finished(scrape(metrics_url)) - before
            bar.n = min(new, want)
            bar.refresh()
            if new >= want:
                break
            time.sleep(0.3)
    return new


@dataclass
class ForcedResult:
    """What the forced requests took: `attempts` calls for `profiles` profiles."""

    profiles: int = 0
    attempts: int = 0
    turned_away: dict[str, int] = field(default_factory=dict)  # decision -> calls
    outcomes: list[str] = field(default_factory=list)  # one line per forced profile


def _decision_of_one_call(metrics_url: str, before: dict[str, float]) -> str:
    """The decision the sidecar took on the call just made: the decision counter that grew
    (a skip is counted when the call's stream ends, so wait a moment for it)."""
    deadline = time.monotonic() + 5
    while True:
        after = sums_by(scrape(metrics_url), DECISIONS, "decision")
        grown = [d for d in after if after[d] > before.get(d, 0.0)]
        if grown or time.monotonic() > deadline:
            return grown[0] if grown else "unknown"
        time.sleep(0.05)


# send(model, k): one call with `x-xsp-profile: 1` for the k-th forced profile
ForcedCall = Callable[[str, int], None]


def send_forced(
    send: ForcedCall, metrics_url: str, db: Path, options: DemoOptions, what: str = "forced profile"
) -> ForcedResult:
    """`options.forced` calls with `x-xsp-profile: 1` (made by `send`), one profile at a time,
    to the models of `options.forced_models` in turn. A forced call still respects the budget
    and the worker's duty cycle, so a call that was turned away (counted, with the decision
    that turned it away) is sent again until one is sampled; then its profile is awaited and
    its outcome printed (a failed profile with the error stored in its trace), each line
    beginning with `what`."""
    result = ForcedResult()
    count = options.forced
    for k in range(count):
        model = options.forced_models[k % len(options.forced_models)]
        label = f"{what} {k + 1}/{count} ({model})"
        text = scrape(metrics_url)
        done_before = finished(text)
        outcomes_before = sums_by(text, PROFILES, "outcome")
        sampled = False
        deadline = time.monotonic() + 60
        while not sampled and time.monotonic() < deadline:
            decisions = sums_by(scrape(metrics_url), DECISIONS, "decision")
            send(model, k)
            result.attempts += 1
            why = _decision_of_one_call(metrics_url, decisions)
            sampled = why == "sampled"
            if not sampled:
                result.turned_away[why] = result.turned_away.get(why, 0) + 1
                time.sleep(0.5)  # the duty-cycle gate is closed; try again
        if not sampled:
            result.outcomes.append(f"{label}: not sampled within 60 s")
            continue
        result.profiles += 1
        wait_for_profiles(metrics_url, done_before, 1, label, timeout=60)
        after = sums_by(scrape(metrics_url), PROFILES, "outcome")
        grown = [o for o in after if after[o] > outcomes_before.get(o, 0.0)]
        outcome = grown[0] if grown else "not finished (still queued or running)"
        line = f"{label}: {outcome}"
        if outcome == "error":
            failed = failed_traces(db, sample_reason="forced", model=model)
            line += f": {failed[0][1]}" if failed else " (the trace store has no error text)"
        result.outcomes.append(line)
        print(f"    {line}", flush=True)
    return result


SKIP_REASONS = {
    "skipped_rate": "not drawn at the {rate:g}% sample rate",
    "skipped_budget": "over the budget of {budget} profiles per minute per model",
    "skipped_duty_cycle": "the profiling worker was at its duty-cycle cap ({duty:g}% busy)",
    "skipped_store_failing": "the trace store was failing",
}


def _skip_reason(decision: str, options: DemoOptions) -> str:
    template = SKIP_REASONS.get(decision, "see the sidecar's log")
    return template.format(
        rate=options.sample_rate * 100, budget=BUDGET_PER_MINUTE, duty=DUTY_CYCLE * 100
    )


# what became of a profile's trace, per outcome other than ok and error (stored as traces);
# the rest (timeout, crash, store_error) are not stored
UNREPLAYED = {
    "live_only": "stored with their live side only (no replay can run the model: status "
    "live_only, the reason in the trace's `replay`)",
}


def _logged_failures(log_path: Path, outcome: str, limit: int = 3) -> list[str]:
    """The sidecar's log lines about profiles that ended in `outcome` (not `ok`)."""
    if not log_path.exists():
        return []
    marker = f": {outcome} ("
    lines = log_path.read_text(errors="replace").splitlines()
    return [line.strip() for line in lines if "profile of" in line and marker in line][:limit]


WITHOUT_BACKEND_SPANS = """
SELECT count(*) FROM traces t WHERE t.status = 'ok' AND t.sample_reason IN ('rate', 'forced')
  AND NOT EXISTS (SELECT 1 FROM spans s WHERE s.trace_id = t.trace_id AND s.level = 'server')
"""


def wait_for_backend_spans(db: Path, timeout: float = 10.0) -> int:
    """Wait until every profiled live sample has Triton's spans (the fidelity check needs its
    compute time), or `timeout` runs out; how many still lack them (the report says why)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            missing = int(conn.execute(WITHOUT_BACKEND_SPANS).fetchone()[0])
        if missing == 0 or time.monotonic() > deadline:
            return missing
        time.sleep(0.25)


def await_sampled(sidecar: SidecarProcess, options: DemoOptions) -> None:
    """Say how many of the traffic's calls were sampled and wait for their profiles."""
    sampled = round(sample_sum(sidecar.metrics(), DECISIONS, decision="sampled"))
    rate = f"{options.sample_rate * 100:g}%"
    say(f"{sampled} of them sampled at {rate}" + ("; their profiles:" if sampled else ""))
    if sampled:
        wait_for_profiles(sidecar.metrics_url, 0, sampled, "profiles of sampled traffic")


def record_and_account(
    sidecar: SidecarProcess,
    out: Path,
    options: DemoOptions,
    counts: dict[str, int],
    forced: ForcedResult,
    db: Path,
    method: str,
    rest: RestTraffic | None = None,
) -> tuple[int, str, list[str]]:
    """Save the final /metrics scrape, show its interesting lines and return the traces
    stored, the scrape and the console lines that add it all up (`account`; `rest`: the REST
    calls sent through the HTTP plane, if any)."""
    stored = count_traces(db)
    metrics_text = sidecar.metrics()
    (out / "metrics.txt").write_text(metrics_text)
    say("what the sidecar recorded (selected /metrics lines):")
    for line in interesting_metrics(metrics_text):
        print(f"    {line}")
    say("adding it up:")
    lines = account(options, counts, forced, metrics_text, db, sidecar.log_path, method, rest)
    return stored, metrics_text, lines


def account(
    options: DemoOptions,
    counts: dict[str, int],
    forced: ForcedResult,
    metrics_text: str,
    db: Path,
    log_path: Path,
    method: str = "ModelInfer",
    rest: RestTraffic | None = None,
) -> list[str]:
    """Console lines that add up: every gRPC `method` call /metrics counted (traffic, forced
    calls and the forced calls sent again, with why), the REST calls beside them (`rest`, sent
    through the HTTP plane), every sampling decision (skips with their reasons), every sampled
    request (profiled or dropped), every profile by outcome (failed ones with their errors)
    and the traces stored."""
    sent = options.requests + forced.attempts
    grpc_calls = counted(metrics_text, GRPC, method=method)
    others = counted(metrics_text, GRPC) - grpc_calls
    retries = forced.attempts - forced.profiles
    lines = [
        f"gRPC requests: {options.requests} traffic + {forced.profiles} forced + {retries} forced "
        f"sent again = {sent} sent; the sidecar counted {grpc_calls} (xsp_requests_total)"
        + ("" if grpc_calls == sent else " (they differ!)"),
    ]
    if others:  # not the demo's: another client found the sidecar's port
        lines.append(f"  and {others} call(s) of other methods the demo did not send")
    for decision, n in sorted(forced.turned_away.items()):
        lines.append(
            f"  {n} forced call(s) sent again: turned away by {decision} "
            f"({_skip_reason(decision, options)})"
        )
    if rest is not None:
        lines.extend(rest_lines(rest, metrics_text, method))
    decisions = {d: round(n) for d, n in sums_by(metrics_text, DECISIONS, "decision").items()}
    sampled = decisions.pop("sampled", 0)
    skipped = sum(decisions.values())
    lines.append(f"sampling decisions: {sampled + skipped} = {sampled} sampled + {skipped} skipped")
    for decision, n in sorted(decisions.items(), key=lambda kv: -kv[1]):
        lines.append(f"  skipped {n}: {_skip_reason(decision, options)} ({decision})")
    outcomes = {o: round(n) for o, n in sums_by(metrics_text, PROFILES, "outcome").items()}
    dropped = {r: round(n) for r, n in sums_by(metrics_text, DROPPED, "reason").items()}
    profiled, dropped_n = sum(outcomes.values()), sum(dropped.values())
    line = f"sampled {sampled} = {profiled} profiled + {dropped_n} dropped"
    if (pending := sampled - profiled - dropped_n) != 0:
        line += f" + {pending} not finished"
    lines.append(line)
    for reason, n in sorted(dropped.items()):
        lines.append(f"  dropped {n}: {reason}")
    lines.append(
        f"profiles: {profiled}"
        + (" = " + " + ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) if outcomes else "")
    )
    failed: dict[tuple[str, str], int] = {}
    for key in failed_traces(db):
        failed[key] = failed.get(key, 0) + 1
    for (model, error), n in sorted(failed.items()):
        lines.append(f"  failed {n} ({model}): {error[:300]}")
    for outcome in sorted(set(outcomes) - {"ok", "error"}):
        logged = _logged_failures(log_path, outcome)
        what = UNREPLAYED.get(outcome, "not stored")
        lines.append(f"  {outcome} {outcomes[outcome]}: {what}; from {log_path.name}:")
        lines.extend(f"    {entry[:300]}" for entry in logged)
    stored, live_only = count_traces(db), count_traces(db, status="live_only")
    lines.append(
        f"traces stored: {stored} ({count_traces(db, status='ok')} ok, "
        f"{count_traces(db, status='error')} failed"
        + (f", {live_only} live-only)" if live_only else ")")
    )
    if rest is not None and stored:
        lines.append(protocol_line(db))
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
        "xsp_backend_captures_total",
    )
    return [line for line in text.splitlines() if line.startswith(keep)]


def report_and_sweep(
    out: Path, db: Path, sweep_model: Path, name: str, options: DemoOptions
) -> Path:
    """Print the report on the sampled live requests (and write it as HTML), then run a
    standalone batch-size sweep of `sweep_model` and report it; returns the sweep's database."""
    report = [sys.executable, str(REPO_ROOT / "analysis" / "report.py")]
    say("report on the sampled live requests (analysis/report.py):")
    subprocess.run([*report, str(db), "--format", options.report_format], check=True)
    subprocess.run(
        [*report, str(db), "--format", "html", "--out", str(out / "report")],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    # The sweep goes to its own database: replays of live samples run in the low-priority
    # worker with one thread, so mixing them into one batch-size curve would mislead.
    sweep = fresh_database(out / "sweep.db")
    say(f"a standalone batch-size sweep of {name} (xsp-sidecar profile):")
    subprocess.run(
        [sys.executable, "-m", "sidecar", "profile", str(sweep_model),
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
    return sweep


def run_demo(options: DemoOptions) -> int:
    out = options.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    db = fresh_database(out / "traces.db")
    otlp_port, admin_port = free_port(), free_port()

    repo = out / MODEL_FOLDER
    say(
        "building the sample model repository (add_sub, simple_cnn, sleep, and the ensemble "
        f"ens_cnn: pre -> simple_cnn) in {repo}"
    )
    shutil.rmtree(repo, ignore_errors=True)  # Triton serves every model in it: only ours
    build_model_repository(repo)
    say("starting Triton (OpenTelemetry tracing to the sidecar's OTLP receiver)")
    otlp_url = f"http://127.0.0.1:{otlp_port}/v1/traces"
    triton = traced_server(repo, out / "tritonserver.log", otlp_url, 200)
    with triton:
        say(f"Triton ready on {triton.grpc_address}; starting the sidecar in front of it")
        args = [
            "--model-repository", str(repo), "--db", str(db),
            "--otlp-port", str(otlp_port), "--sample-rate", str(options.sample_rate),
            "--sample-budget", str(BUDGET_PER_MINUTE), "--duty-cycle", str(DUTY_CYCLE),
            "--levels", "M,L", "--admin", "--admin-listen", f"127.0.0.1:{admin_port}",
        ]  # fmt: skip
        log_path = out / "sidecar.log"
        sidecar = SidecarProcess(
            triton.grpc_address, log_path, args, http_backend=triton.http_address,
            keep_xsp_env=True,
        )  # fmt: skip
        with sidecar:
            relay = sidecar.address
            say(f"sidecar relaying gRPC on {relay} and REST on {sidecar.http_address}; metrics "
                f"on :{sidecar.metrics_port}/metrics")  # fmt: skip
            counts = send_traffic(relay, options)
            say(f"sent {options.requests} requests: {counts['ok']} ok, {counts['error']} errors")
            rest = None
            if options.rest_requests:
                rest = send_rest_traffic(sidecar.http_address, options)
                say(f"sent {rest.total} REST requests ("
                    + ", ".join(f"{n} {client}" for client, n in rest.sent.items())
                    + f"): {rest.total - rest.errors} ok, {rest.errors} errors")  # fmt: skip
            await_sampled(sidecar, options)
            models = ", ".join(options.forced_models)
            say(f"sending {options.forced} request(s) with x-xsp-profile: 1 to {models}")
            client = grpcclient.InferenceServerClient(relay)
            rng = np.random.default_rng(1)

            def infer_forced(model: str, k: int) -> None:
                client.infer(model, _inputs(model, k, rng), headers={"x-xsp-profile": "1"})

            forced = send_forced(infer_forced, sidecar.metrics_url, db, options)
            client.close()
            if rest is not None:
                send_rest_forced(sidecar, db, options, rest)
            wait_for_backend_spans(db)  # Triton exports its spans in batches
            stored, _, lines = record_and_account(
                sidecar, out, options, counts, forced, db, "ModelInfer", rest
            )
            for line in lines:
                print(f"    {line}")
    say(f"{stored} trace(s) of sampled requests stored in {db} (failed profiles included)")
    sweep = report_and_sweep(out, db, repo / "simple_cnn" / "1" / "model.onnx", "simple_cnn",
                             options)  # fmt: skip
    say("done. Results:")
    print(f"    sampled traces : {db}  (HTML report in {out / 'report'})")
    print(f"    batch sweep    : {sweep}  (HTML report in {out / 'sweep-report'})")
    print(f"    metrics scrape : {out / 'metrics.txt'}")
    print(f"    logs           : {out / 'sidecar.log'}, {out / 'tritonserver.log'}")
    print(f"    try            : python analysis/report.py {db} --format markdown")
    return 0
