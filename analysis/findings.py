"""Findings: what the analyses say to do, one sentence each, with the evidence.

Beyond XSP (whose analyses describe but do not advise): each rule reads the results of the
analyses it names and, where its threshold is crossed, returns a `Finding` with the numbers
that triggered it and a suggested action. A rule whose analysis was not captured stays
silent. The thresholds are module constants so that a report can say what they were.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from analysis.analyses import ensemble_steps
from analysis.analyses.common import AnalysisResult
from analysis.analyses.fidelity import SAME_KERNELS
from analysis.analyses.roofline import peak_doubtful
from analysis.load.tracedb import TraceData
from sidecar.profiling.gpu.owner import MODEL_LEVEL_AFTER_CUPTI

log = logging.getLogger(__name__)

IDLE_SHARE = 0.5  # launch-bound: the device idles at least this share of the model's time
MEMORY_BOUND_SHARE = 0.25  # memory-bound layers take at least this share of layer time
MATMUL_SHARE = 0.3  # GEMM/conv kernels take at least this share of kernel time ...
TENSOR_CORE_SHARE = 0.2  # ... and tensor-core kernels less than this share of theirs
OVERHEAD_ADDED = 0.5  # a level's profilers added at least 50% to the model latency
QUEUE_SHARE = 0.25  # live: queue time is at least this share of the client's latency
# live: backend work after the response left is at least this share of the client's latency
AFTER_RESPONSE_SHARE = 0.25
# streams: the time to the first response is at least this share of a streamed request's
# latency (requests answered more than once) ...
FIRST_RESPONSE_SHARE = 0.8
GAP_SPREAD = 3.0  # ... or the p90 gap between responses is more than this many p50 gaps
# ensembles: the step that holds at least this share of the time all its steps take dominates
# (a majority: the one step whose speed-up shortens the pipeline most)
DOMINANT_STEP_SHARE = 0.5
# ensembles: time no step holds (between steps, or the ensemble's own before its first step and
# after its last) is at least this share of the client's latency. Triton hands a step's output
# tensors to the next step in its own process, normally in tens of microseconds; a fifth of the
# latency there means copies (between devices or memory types) or a scheduler waiting on
# something, and is worth as much as a step's own compute
BETWEEN_STEPS_SHARE = 0.2

Results = Callable[[str], AnalysisResult]


@dataclass(frozen=True)
class Finding:
    """One piece of advice: what was found, the evidence (numbers and their analysis) and
    the suggested action."""

    rule: str
    subject: str  # the model (or "all")
    finding: str
    evidence: str
    action: str
    analyses: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["analyses"] = list(self.analyses)
        return out


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _span(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return _pct(lo) if round(lo * 100) == round(hi * 100) else f"{_pct(lo)}-{_pct(hi)}"


def replay_fidelity(results: Results, data: TraceData) -> list[Finding]:
    """A replay that does not run as the server runs: its absolute times do not hold."""
    fd = results("fidelity")
    if not fd.ok:
        return []
    out = []
    bad = fd.table[fd.table["verdict"] == "the replay does not represent the server"]
    for model, grp in bad.groupby("model", sort=True, observed=True):
        batches = ", ".join(str(b) for b in grp["batch_size"])
        ratios = [float(r) for r in grp["ratio_p50"]]
        lo, hi = min(ratios), max(ratios)
        times = f"{lo:.2g}x" if f"{lo:.2g}" == f"{hi:.2g}" else f"{lo:.2g}-{hi:.2g}x"
        same = all(
            fd.extra.get(SAME_KERNELS, {}).get(f"{model}|{b}", True) for b in grp["batch_size"]
        )
        shares = (
            "shares of layer and kernel time (A3's latency_share, A5-A7, A10, A11) may still "
            "hold: the server runs the same model file on the same kind of device"
            if same
            else "shares do not hold either: the server runs other kernels (another device or "
            "execution accelerator)"
        )
        causes = "; ".join(dict.fromkeys(c for c in grp["differences"] if c))
        out.append(
            Finding(
                "replay_fidelity",
                str(model),
                f"{model}: the replay does not represent the server: it takes {times} the "
                f"server's own compute time (batch {batches})",
                f"fidelity: replay p50 {_ms(grp['replay_p50_ms'])} ms vs the server's "
                f"{_ms(grp['live_p50_ms'])} ms over {int(grp['requests'].sum())} sampled "
                f"requests; {causes}",
                "absolute times (A1's latency, layer and kernel ms in A2-A4, A8-A14) do not "
                f"hold for production; {shares}",
                ("fidelity",),
            )
        )
    return out


def _ms(values: pd.Series) -> str:
    lo, hi = float(values.min()), float(values.max())
    return f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}-{hi:.3g}"


def slow_requests(results: Results, data: TraceData) -> list[Finding]:
    """Requests sampled for their latency: slow because of their input, or of the server."""
    fd = results("fidelity")
    if not fd.ok:
        return []
    out = []
    rows = fd.table[(fd.table["slow_requests"] > 0) & fd.table["slow_reproduced"].notna()]
    for model, grp in rows.groupby("model", sort=True, observed=True):
        n, hit = int(grp["slow_requests"].sum()), int(grp["slow_reproduced"].sum())
        evidence = (
            f"fidelity: {hit} of {n} slow-sampled requests' replays took at least "
            "1.5x the median replay of the model's other samples at the same batch size"
        )
        if hit:
            out.append(
                Finding(
                    "slow_requests",
                    str(model),
                    f"{model}: {hit} of {n} slow requests were slow in their replay too: "
                    "their input makes the model slower",
                    evidence,
                    "look at where in the layer table (A2, `--trace ID` for one request) those "
                    "inputs spend the time",
                    ("fidelity", "A2"),
                )
            )
        if n - hit:
            out.append(
                Finding(
                    "slow_requests",
                    str(model),
                    f"{model}: {n - hit} of {n} slow requests ran as fast as the others in "
                    "their replay: the server made them slow (queueing, batching or "
                    "contention), not their input",
                    evidence,
                    "see which phase of the live breakdown grows (queue, compute_infer) and "
                    "the batches the server ran (trace attribute fidelity.server_batch_window)",
                    ("fidelity", "live_breakdown"),
                )
            )
    return out


def optimal_batch(results: Results, data: TraceData) -> list[Finding]:
    """The optimal batch size per model (A1), or which batch sizes to measure next."""
    a1 = results("A1")
    if not a1.ok:
        return []
    out = []
    table = _whole_requests(a1.table).dropna(subset=["batch_size"])  # not a step's rows
    for model, decision in sorted(a1.extra.get("batch_decision", {}).items()):
        grp = table[table["model"] == model]
        measured = ", ".join(str(int(b)) for b in sorted(grp["batch_size"]))
        evidence = f"A1 over batch sizes {measured}: {decision['reason']}"
        nxt = ",".join(str(b) for b in decision["measure_next"])
        if decision["status"] == "decided":
            b = decision["optimal"]
            thr = float(grp.loc[grp["batch_size"] == b, "throughput_per_s"].iloc[0])
            out.append(
                Finding(
                    "optimal_batch",
                    model,
                    f"{model}: the optimal batch size is {b} ({thr:.4g} inputs/s)",
                    evidence,
                    f"serve {model} with batches of {b} (e.g. Triton dynamic batching with "
                    f"preferred_batch_size {b}); larger batches add latency, not throughput",
                    ("A1",),
                )
            )
        elif decision["status"] == "not_yet_known":
            out.append(
                Finding(
                    "optimal_batch",
                    model,
                    f"{model}: the optimal batch size is not yet known",
                    evidence,
                    f"profile batch size(s) {nxt}: `xsp-sidecar profile MODEL --batch-size "
                    f"{measured.replace(' ', '')},{nxt} --db ...`",
                    ("A1",),
                )
            )
        else:
            out.append(
                Finding(
                    "optimal_batch",
                    model,
                    f"{model}: the optimal batch size is uncertain (the measurements are noisy)",
                    evidence,
                    f"repeat batch sizes {nxt} (more --iterations, or several profiles) on a "
                    "quiet machine before choosing",
                    ("A1",),
                )
            )
    return out


def launch_bound(results: Results, data: TraceData) -> list[Finding]:
    """The device idles most of the model's time: launches, not kernels, set the pace."""
    tb = results("time_breakdown")
    if not tb.ok:
        return []
    out = []
    for model, grp in tb.table.groupby("model", sort=True, observed=True):
        idle = grp[grp["idle_pct"] >= IDLE_SHARE * 100]
        if idle.empty:
            continue
        worst = idle.sort_values("idle_pct").iloc[-1]
        batches = ", ".join(str(int(b)) for b in idle["batch_size"].dropna())
        out.append(
            Finding(
                "launch_bound",
                str(model),
                f"{model}: the GPU is idle {_span(list(idle['idle_pct'] / 100))} of the model's "
                f"time (batch {batches}): the host's kernel launches, not the GPU, set the pace",
                f"time_breakdown (K run timeline): kernels busy {worst['kernel_ms']:.4g} ms of a "
                f"{worst['window_ms']:.4g} ms model run at batch {int(worst['batch_size'])}",
                "raise the batch size, capture the model in a CUDA graph, or compile it "
                "(torch.compile, TensorRT) so that fewer, larger launches keep the GPU busy",
                ("time_breakdown",),
            )
        )
    return out


def memory_bound_layers(results: Results, data: TraceData) -> list[Finding]:
    """Layers left of the ridge point take a large share of the layer time (A14)."""
    a14 = results("A14")
    if not a14.ok:
        return []
    out = []
    table = a14.table[a14.table["bound"] != "unknown"]
    for model, grp in table.groupby("model", sort=True, observed=True):
        batch = grp["batch_size"].max()
        g = grp[grp["batch_size"] == batch] if pd.notna(batch) else grp
        total = float(g["latency_ms"].sum())
        mem = g[g["bound"] == "memory"].sort_values("latency_ms", ascending=False)
        if total <= 0 or mem.empty:
            continue
        share = float(mem["latency_ms"].sum()) / total
        if share < MEMORY_BOUND_SHARE:
            continue
        top = ", ".join(
            f"{r.name} ({r.type}, {_pct(r.latency_ms / total)})"
            for r in mem.head(3).itertuples(index=False)
        )
        est = " (FLOPs/bytes estimated from shapes)" if bool(g["estimated"].any()) else ""
        ridge = float(g["ridge_point"].median())
        out.append(
            Finding(
                "memory_bound_layers",
                str(model),
                f"{model}: memory-bound layers take {_pct(share)} of the layer time at batch "
                f"{'-' if pd.isna(batch) else int(batch)}",
                f"A14{est}: {len(mem)} of {len(g)} layers have an arithmetic intensity below "
                f"the ridge point ({ridge:.3g} FLOP/byte); largest: {top}",
                "cut their bytes: keep graph optimizations on so elementwise ops fuse into "
                "their neighbours, use lower precision (FP16/BF16/INT8) or a larger batch",
                ("A14",),
            )
        )
    return out


# Kernel names: GEMM / convolution work, and the marks of a tensor-core kernel in it.
_MATMUL = re.compile(r"gemm|conv|fprop|dgrad|wgrad|cutlass|xmma|fmha|attention|winograd", re.I)
_TENSOR = re.compile(
    r"tensorop|tf32|hmma|imma|wgmma|gmma|h884|h1688|h16816|s1688|s16816|i8816|bf16|f16|fp16|"
    r"half|int8",
    re.I,
)


def tensor_core_use(kernels: pd.DataFrame) -> tuple[float, float, str] | None:
    """(share of kernel time in GEMM/conv kernels, share of that in tensor-core kernels, the
    longest FP32 GEMM/conv kernel) from kernel `name` and `duration_ns`; None if no kernels."""
    total = float(kernels["duration_ns"].sum())
    if total <= 0:
        return None
    kernels = kernels.groupby("name", as_index=False, observed=True)[
        "duration_ns"
    ].sum()  # once per name
    names = kernels["name"].astype(str)
    matmul = kernels[names.str.contains(_MATMUL)]
    mm_total = float(matmul["duration_ns"].sum())
    if mm_total <= 0:
        return 0.0, 0.0, ""
    is_tc = matmul["name"].astype(str).str.contains(_TENSOR)
    fp32 = matmul[~is_tc]
    longest = ""
    if not fp32.empty:
        longest = str(fp32.sort_values("duration_ns").iloc[-1]["name"])
    return mm_total / total, float(matmul.loc[is_tc, "duration_ns"].sum()) / mm_total, longest


def tensor_cores_unused(results: Results, data: TraceData) -> list[Finding]:
    """FP32 GEMM/conv kernels without a tensor-core path dominate a GPU trace (kernel names
    in A10, summed over the batch sizes of each model)."""
    a10 = results("A10")
    if not a10.ok:
        return []
    kn = a10.table[a10.table["kind"] == "kernel"]
    out = []
    for model, grp in kn.groupby("model", sort=True, observed=True):
        use = tensor_core_use(grp.assign(duration_ns=grp["latency_ms"] * 1e6))
        if use is None:
            continue
        mm_share, tc_share, longest = use
        if mm_share < MATMUL_SHARE or tc_share >= TENSOR_CORE_SHARE:
            continue
        out.append(
            Finding(
                "tensor_cores_unused",
                str(model),
                f"{model}: tensor cores are barely used: GEMM/convolution kernels take "
                f"{_pct(mm_share)} of the kernel time and {_pct(1 - tc_share)} of that runs on "
                "FP32 units",
                f"A10 (kernel names): no tensor-core mark (tensorop, tf32, hmma, f16, ...) in "
                f"the longest ones, e.g. {longest[:90]}",
                "allow TF32 (torch.backends.cuda.matmul.allow_tf32 = True, "
                "torch.backends.cudnn.allow_tf32 = True) or run in FP16/BF16 "
                "(torch.autocast, ONNX Runtime float16 models)",
                ("A10",),
            )
        )
    return out


def profiler_overhead(results: Results, data: TraceData) -> list[Finding]:
    """A level's profilers slowed the model so much that its absolute times mislead."""
    ov = results("overhead")
    if not ov.ok:
        return []
    out = []
    heavy = ov.table[ov.table["added_pct"] >= OVERHEAD_ADDED * 100]
    for (model, level), grp in heavy.groupby(["model", "level"], sort=True, observed=True):
        added = list(grp["added_pct"] / 100)
        ratios = f"{grp['overhead_ratio'].min():.3g}"
        if f"{grp['overhead_ratio'].max():.3g}" != ratios:
            ratios += f"-{grp['overhead_ratio'].max():.3g}"
        shares = (
            "A3 latency_share"
            if level == "layer"
            else "the kernel percentages of time_breakdown and A11"
        )
        out.append(
            Finding(
                "profiler_overhead",
                str(model),
                f"{model}: {level}-level profiling made the model {_span(added)} slower, so "
                f"absolute {level} times overstate the real ones",
                f"overhead: the {level} run's model latency is {ratios}x the M run's "
                f"(batch {', '.join(str(int(b)) for b in grp['batch_size'].dropna())})",
                f"compare {level}s by their share of the run ({shares}), not in ms; take "
                "the model's latency from A1 (the M run, no profilers)",
                ("overhead",),
            )
        )
    return out


def live_queue(results: Results, data: TraceData) -> list[Finding]:
    """Live requests wait in the backend's queue for a large share of their latency."""
    return _live_phase(
        results,
        "live_queue",
        ("queue",),
        QUEUE_SHARE,
        lambda row: (
            f"{row.model}: live requests spend {_pct(row.share_of_client)} of their "
            "latency waiting in the backend's queue",
            f" of the client's latency, over {row.requests} sampled requests",
            "add model instances (Triton instance_group count) or enable dynamic "
            "batching so that queued requests are served together",
        ),
    )


def _live_phase(
    results: Results,
    rule: str,
    phases: tuple[str, ...],
    share: float,
    words: Callable[[Any], tuple[str, str, str]],
) -> list[Finding]:
    """A finding per whole-request row of live_breakdown whose phase is one of `phases` and
    takes at least `share` of the client's latency. `words(row)`: its finding, its evidence
    after the phase's mean and p90 (`live_breakdown: queue 1 ms mean (p90 2 ms)`), and its
    advice."""
    lb = results("live_breakdown")
    if not lb.ok:
        return []
    whole = _whole_requests(lb.table)
    rows = whole[whole["phase"].isin(phases) & (whole["share_of_client"] >= share)]
    out = []
    for row in rows.itertuples(index=False):
        finding, evidence, advice = words(row)
        out.append(
            Finding(
                rule,
                str(row.model),
                finding,
                f"live_breakdown: {row.phase} {row.mean_ms:.3g} ms mean (p90 {row.p90_ms:.3g} "
                f"ms){evidence}",
                advice,
                ("live_breakdown",),
            )
        )
    return out


def _whole_requests(lb: pd.DataFrame) -> pd.DataFrame:
    """An analysis' rows of whole requests (not an ensemble's step rows: live_breakdown, A1)."""
    return lb[lb["step"] == ""] if "step" in lb.columns else lb


def _step_rows(lb: pd.DataFrame) -> pd.DataFrame:
    if "step" not in lb.columns:
        return lb.iloc[:0]
    return lb[(lb["step"] != "") & lb["phase"].isin(ensemble_steps.STEP_PHASES)]


def _replayed_steps(results: Results) -> dict[str, str]:
    """Per ensemble: its replayed steps' latencies from A1's step rows, as evidence."""
    a1 = results("A1")
    if not a1.ok or "step" not in a1.table.columns:
        return {}
    rows = a1.table[a1.table["step"] != ""]
    return {
        str(model): "replayed (A1): "
        + ", ".join(f"{r.step} {r.latency_ms:.3g} ms" for r in grp.itertuples(index=False))
        for model, grp in rows.groupby("model", sort=True, observed=True)
    }


def dominant_step(results: Results, data: TraceData) -> list[Finding]:
    """The step of an ensemble that takes most of its steps' time (live, from Triton's spans;
    its replayed steps' latencies beside, where A1 has them). A step's time is its phases'
    medians (p50) summed: one slow request (a cold first one, say) cannot pick the step."""
    lb = results("live_breakdown")
    if not lb.ok:
        return []
    replayed = _replayed_steps(results)
    whole = _whole_requests(lb.table)
    client = whole[whole["phase"] == "client_total"].set_index("model")["p50_ms"]
    out = []
    for model, grp in _step_rows(lb.table).groupby("model", sort=True, observed=True):
        per_step = grp.groupby("step", sort=True)["p50_ms"].sum()
        total = float(per_step.sum())
        if total <= 0:
            continue
        top = per_step.idxmax()
        share = float(per_step[top]) / total
        if share < DOMINANT_STEP_SHARE:
            continue
        rows = grp[grp["step"] == top].set_index("phase")
        phase = str(rows["p50_ms"].idxmax())
        name = str(top).split(". ", 1)[-1]
        others = ", ".join(
            f"{str(s).split('. ', 1)[-1]} {float(v):.3g} ms"
            for s, v in per_step.items()
            if s != top
        )
        of_client = float(per_step[top]) / float(client.get(model, float("nan")))
        out.append(
            Finding(
                "dominant_step",
                str(model),
                f"{model}: step {name} takes {_pct(share)} of the ensemble's step time "
                f"({_pct(of_client)} of the client's median latency), by median",
                f"live_breakdown: step {top} {float(per_step[top]):.3g} ms (its phases' p50s "
                f"summed), most of it {phase} ({float(rows.at[phase, 'p50_ms']):.3g} ms p50); "
                f"other steps: {others or 'none'}; from Triton's spans; "
                + replayed.get(str(model), "no replay of the steps"),
                f"profile {name} itself (its own traces, or a replay of it) and speed it up "
                "first; the other steps cannot shorten the pipeline as much",
                ("live_breakdown",),
            )
        )
    return out


def between_steps(results: Results, data: TraceData) -> list[Finding]:
    """An ensemble whose requests spend a large share of their latency outside every step."""
    return _live_phase(
        results,
        "between_steps",
        ("between_steps", "ensemble_overhead"),
        BETWEEN_STEPS_SHARE,
        lambda row: (
            f"{row.model}: live requests spend {_pct(row.share_of_client)} of their latency "
            + (
                "between its steps (the scheduler handing one step's outputs to the next)"
                if row.phase == "between_steps"
                else "in the ensemble itself, before its first step or after its last"
            ),
            f" over {row.requests} sampled requests; threshold "
            f"{_pct(BETWEEN_STEPS_SHARE)} of the client's latency",
            "look for tensor copies between steps (GPU and CPU memory, or outputs a step "
            "does not need), or fuse small steps into one model",
        ),
    )


def post_response_work(results: Results, data: TraceData) -> list[Finding]:
    """The backend goes on working after the response left: the instance stays busy, so the
    next request waits although the client already has its answer."""
    return _live_phase(
        results,
        "post_response_work",
        ("server_after_response",),
        AFTER_RESPONSE_SHARE,
        lambda row: (
            f"{row.model}: the backend works {row.mean_ms:.3g} ms per request after the "
            f"response left ({_pct(row.share_of_client)} of the client's latency), holding "
            "its instance busy after the answer",
            f" over {row.requests} sampled requests, placed on the relay's clock",
            "move cleanup out of the request (a Python backend's per-request teardown, "
            "large output copies released late) or add instances so the next request "
            "need not wait for it",
        ),
    )


def stream_first_response(results: Results, data: TraceData) -> list[Finding]:
    """A streamed request waits for its first response most of its time: the model starts
    answering late (queue or prefill), not streaming slowly."""
    sr = results("stream_responses")
    if not sr.ok:
        return []
    t = sr.table
    rows = t[(t["responses_p50"] > 1) & (t["first_response_share"] >= FIRST_RESPONSE_SHARE)]
    return [
        Finding(
            "stream_first_response",
            str(row.model),
            f"{row.model}: streamed requests wait {_pct(row.first_response_share)} of their "
            "latency for their first response",
            f"stream_responses: first response p50 {row.first_response_ms_p50:.3g} ms of a "
            f"p50 latency of {row.latency_ms_p50:.3g} ms, {row.responses_p50:.3g} responses "
            f"per request (p50), over {row.requests} sampled stream messages",
            "look at what comes before the first response: the backend's queue "
            "(live_breakdown), too few instances, or a long first step of the model "
            "(prefill); answer early and stream the rest",
            ("stream_responses",),
        )
        for row in rows.itertuples(index=False)
    ]


def stream_gap_spread(results: Results, data: TraceData) -> list[Finding]:
    """The gaps between streamed responses vary widely: the stream stalls now and then."""
    sr = results("stream_responses")
    if not sr.ok:
        return []
    t = sr.table
    rows = t[(t["gaps"] >= 2) & (t["gap_ms_p50"] > 0)]
    rows = rows[rows["gap_ms_p90"] > GAP_SPREAD * rows["gap_ms_p50"]]
    return [
        Finding(
            "stream_gap_spread",
            str(row.model),
            f"{row.model}: the gaps between streamed responses vary widely (p90 "
            f"{row.gap_ms_p90 / row.gap_ms_p50:.3g}x p50): the stream stalls now and then",
            f"stream_responses: gap p50 {row.gap_ms_p50:.3g} ms, p90 {row.gap_ms_p90:.3g} ms, "
            f"p99 {row.gap_ms_p99:.3g} ms over {row.gaps} gaps of {row.requests} sampled "
            "stream messages",
            "find what interrupts the model's response loop: other requests sharing its "
            "instance (add instances), work between responses on the host, or responses "
            "held back and sent in bursts",
            ("stream_responses",),
        )
        for row in rows.itertuples(index=False)
    ]


def failed_profiles(results: Results, data: TraceData) -> list[Finding]:
    """Profiles that failed, and why (they are left out of every analysis)."""
    if not data.failed_reasons:
        return []
    n = sum(data.failed_reasons.values())
    reasons = "; ".join(
        f"{count}x {reason[:160]}"
        for reason, count in sorted(data.failed_reasons.items(), key=lambda kv: -kv[1])[:3]
    )
    return [
        Finding(
            "failed_profiles",
            "all",
            f"{n} profile(s) failed and are left out of the analyses",
            f"traces with status != ok: {reasons}",
            "fix the cause above (see the sidecar's log); add --include-errors to list them",
            (),
        )
    ]


def model_level_after_cupti(results: Results, data: TraceData) -> list[Finding]:
    """Profiles whose M ran in a process where a CUPTI client had already recorded (a sweep
    of `xsp-sidecar profile` with K on a GPU): CUPTI left attached slows later forwards."""
    traces = data.traces
    hit = traces["attributes"].map(
        lambda a: isinstance(a, dict) and bool(a.get(MODEL_LEVEL_AFTER_CUPTI))
    )
    if not hit.any():
        return []
    out = []
    for model, group in traces[hit.to_numpy(bool)].groupby("model", observed=True, sort=True):
        client = group["attributes"].iloc[0][MODEL_LEVEL_AFTER_CUPTI]
        out.append(
            Finding(
                "model_level_after_cupti",
                str(model),
                f"{len(group)} profile(s) timed M after {client} had recorded in the same "
                "process, so their M may read high and every level's overhead ratio low",
                f"trace attribute {MODEL_LEVEL_AFTER_CUPTI} on batch size(s) "
                f"{', '.join(str(b) for b in sorted(set(group['batch_size'].dropna())))}; "
                "forwards after CUPTI ran were 1.20-1.28x slower at launch-bound batch sizes "
                "on an H100 (docs/benchmarks.md)",
                "profile one batch size per `xsp-sidecar profile` run, or leave the kernel "
                "level out of the sweep",
                (),
            )
        )
    return out


def peak_below_achieved(results: Results, data: TraceData) -> list[Finding]:
    """A layer ran faster than the recorded peak: the peak was measured too low. A layer
    above the roof of the cache that holds its working set is no such evidence
    (`roofline.peak_doubtful`; A14 notes it instead)."""
    a14 = results("A14")
    if not a14.ok or "above_roof" not in a14.table.columns:
        return []
    above = a14.table[peak_doubtful(a14.table)]
    if above.empty:
        return []
    worst = above.sort_values("arithmetic_throughput_gflops").iloc[-1]
    return [
        Finding(
            "peak_below_achieved",
            str(worst["model"]),
            f"the recorded peak is below what {len(above)} layer(s) achieved, so utilization "
            "and bound verdicts against it are not shown as facts",
            f"A14: {worst['name']} ({worst['type']}) ran at "
            f"{worst['arithmetic_throughput_gflops']:.4g} GFLOP/s against an attainable "
            f"{worst['attainable_gflops']:.4g} GFLOP/s",
            "re-measure the peak on an idle machine (`xsp-sidecar profile ... --refresh-peak`) "
            "and profile again",
            ("A14",),  # the evidence's analysis (A15 hides its verdicts the same way)
        )
    ]


RULES: tuple[Callable[[Results, TraceData], list[Finding]], ...] = (
    replay_fidelity,  # first: when the copy does not represent the server, the rest is read so
    failed_profiles,
    optimal_batch,
    launch_bound,
    tensor_cores_unused,
    memory_bound_layers,
    live_queue,
    dominant_step,
    between_steps,
    post_response_work,
    stream_first_response,
    stream_gap_spread,
    slow_requests,
    profiler_overhead,
    model_level_after_cupti,
    peak_below_achieved,
)


def find(results: Results, data: TraceData) -> list[Finding]:
    """Every rule's findings, in rule order. A rule that raises (on an analysis that failed,
    say: its section shows why) gives none, and the others still run."""
    if data.empty:
        return []
    out: list[Finding] = []
    for rule in RULES:
        try:
            out.extend(rule(results, data))
        except Exception as exc:
            log.warning("finding rule %s failed: %s: %s", rule.__name__, type(exc).__name__, exc)
    return out


def table(findings: Sequence[Finding]) -> pd.DataFrame:
    cols = ["rule", "subject", "finding", "evidence", "action"]
    return pd.DataFrame([{c: getattr(f, c) for c in cols} for f in findings], columns=cols)
