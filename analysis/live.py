"""The live request breakdown: what the client waited for, phase by phase, per model.

The proxy's request span is the latency the client observed (level `request`). The backend's
spans (level `server`, e.g. Triton's OpenTelemetry spans) split the server's share into queue
and compute input / infer / output. `network_proxy` is client latency - the server's request
span: network, the relay and gRPC framing. `server_other` is the server's request span - its
phases. Percentiles are over the sampled requests of each model.

A TF-Serving backend has no request span: its profiler's capture gives the TensorFlow op
events in the request's window (kind `tf_op`). `tf_ops` is their envelope, from the first op's
start to the last op's end (the server running the model; ops of concurrent requests that
overlap the window are in it too), and `outside_tf_ops` is client latency - `tf_ops`: network,
the relay, gRPC framing and TF-Serving's own request handling (tensor decode and encode).
"""

from __future__ import annotations

import pandas as pd

from analysis.common import AnalysisResult, Frames, empty_result, not_captured

TITLE = "Live request breakdown (client latency at the proxy vs backend phases)"
BACKEND_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
TF_OP_KIND = "tf_op"  # sidecar.live.tf_profiler.SPAN_KIND
PHASES = (
    "client_total", "network_proxy", *BACKEND_PHASES, "server_other", "tf_ops", "outside_tf_ops"
)  # fmt: skip
PERCENTILES = (0.5, 0.9, 0.99)


def request_phases(fr: Frames) -> pd.DataFrame:
    """One row per sampled request (trace): model and every phase in ns (NaN if unknown)."""
    req = fr.at("request").sort_values(["tkey", "start_ns"])
    req = req.drop_duplicates("tkey")[["tkey", "duration_ns"]]
    out = req.rename(columns={"duration_ns": "client_total"}).set_index("tkey")
    srv = fr.at("server")
    srv = srv[srv["tkey"].isin(out.index)]
    ops = srv["kind"] == TF_OP_KIND
    wide = srv[~ops].pivot_table(index="tkey", columns="kind", values="duration_ns", aggfunc="sum")
    for col in ("request", *BACKEND_PHASES):
        out[col] = wide[col] if col in wide.columns else float("nan")
    envelope = srv[ops].groupby("tkey").agg(start=("start_ns", "min"), end=("end_ns", "max"))
    out["tf_ops"] = envelope["end"] - envelope["start"]
    out = out.astype("float64")
    phase_sum = out[list(BACKEND_PHASES)].sum(axis=1, min_count=1)
    out["network_proxy"] = out["client_total"] - out["request"]
    out["server_other"] = out["request"] - phase_sum
    out["outside_tf_ops"] = out["client_total"] - out["tf_ops"]
    return fr.with_meta(out.drop(columns=["request"]).reset_index(), ["model"])


def live_breakdown(fr: Frames) -> AnalysisResult:
    if fr.data.empty:
        return empty_result("live_breakdown", TITLE)
    per = request_phases(fr)
    if per.empty:
        return not_captured(
            "live_breakdown",
            TITLE,
            "no live spans: the selected traces were not sampled from live traffic (they "
            "hold no request-level spans from the proxy; e.g. `xsp-sidecar profile` traces)",
        )
    long = per.melt(id_vars=["model", "tkey"], value_vars=list(PHASES), var_name="phase")
    long = long.dropna(subset=["value"])
    long["value"] = long["value"] / 1e6
    g = long.groupby(["model", "phase"])["value"]
    table = g.agg(requests="size", mean_ms="mean").reset_index()
    for q in PERCENTILES:
        col = f"p{round(q * 100)}_ms"
        table = table.merge(
            g.quantile(q).rename(col).reset_index(), on=["model", "phase"], how="left"
        )
    client = table[table["phase"] == "client_total"].set_index("model")["mean_ms"]
    table["share_of_client"] = table["mean_ms"] / table["model"].map(client)
    table["phase"] = pd.Categorical(table["phase"], categories=list(PHASES), ordered=True)
    table = table.sort_values(["model", "phase"]).reset_index(drop=True)
    table["phase"] = table["phase"].astype(str)
    res = AnalysisResult("live_breakdown", TITLE, table)
    no_server = (per["network_proxy"].isna() & per["tf_ops"].isna()).sum()
    if per["tf_ops"].notna().any():
        res.notes.append(
            "tf_ops: from the first to the last TensorFlow op event the backend's profiler "
            "captured in the request's window (ops of concurrent requests in that window "
            "count too); outside_tf_ops = client_total - tf_ops"
        )
    if no_server:
        res.notes.append(
            f"{no_server} sampled requests have no backend spans (backend tracing off or its "
            "spans did not arrive); they count only in client_total"
        )
    return res
