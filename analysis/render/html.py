"""The HTML report: every analysis as a table, with plots embedded as PNG data URIs.

Plots (matplotlib, imported only here, so the rest of `analysis` works without a display):
batch-size curve (A1), layer latency bars (A3), latency by layer type (A6), kernel and layer
rooflines (A9, A14), the live request breakdown and the model time breakdown.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from analysis.analyses import ensemble_steps
from analysis.analyses.common import AnalysisResult
from analysis.load import damage
from analysis.render.text import (
    Front,
    fmt_value,
    for_display,
    headline,
    label,
    same_for,
    status_lines,
)
from sidecar.trace import schema

MAX_HTML_ROWS = 200
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;
max-width:1600px}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
th{background:#f4f4f4}
.status{background:#fff4e0;border-left:4px solid #f0a020;padding:6px 10px}
.note{color:#666;font-size:12px}.est{color:#b35c00;font-weight:bold}
img{max-width:100%;display:block;margin:8px 0}nav a{margin-right:10px;font-size:13px}
.tw{max-width:100%;overflow-x:auto}td{max-width:28em;overflow-wrap:break-word}
ol.findings li{margin:6px 0}ol.findings .ev,ol.findings .act{font-size:13px;color:#444}
ol.findings .act{color:#14532d}
"""


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _fig(width: float = 7.5, height: float = 3.6) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def plot_batch_curve(res: AnalysisResult) -> list[str]:
    df = res.table.dropna(subset=["batch_size"])
    if "step" in df.columns:  # the models' curves, not an ensemble's steps
        df = df[df["step"] == ""]
    if df.empty:
        return []
    fig, ax = _fig()
    ax2 = ax.twinx()
    colors = _type_colors(df["model"].astype(str))
    for model, g in df.groupby("model", observed=True):
        g = g.sort_values("batch_size")
        c = colors[str(model)]
        ax.plot(g["batch_size"], g["throughput_per_s"], "o-", color=c, label=f"{model} throughput")
        ax2.plot(g["batch_size"], g["latency_ms"], "s--", color=c, alpha=0.5)
    best = df[df["optimal"]]
    if not best.empty:
        ax.scatter(
            best["batch_size"],
            best["throughput_per_s"],
            s=180,
            facecolors="none",
            edgecolors="red",
            linewidths=2,
            zorder=5,
            label="optimal batch",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (inputs/s)")
    ax2.set_ylabel("latency (ms, dashed)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("A1: throughput and latency per batch size")
    return [_png(fig)]


MAX_BARS = 160  # A3: above this many bars (layers x batch sizes), lines over the layer index


def plot_layer_latency(res: AnalysisResult) -> list[str]:
    """A3: per model, each layer's latency in execution order for every batch size: one bar
    per batch size and layer, or for a large model one line per batch size."""
    out = []
    table = res.table
    if "step" in table.columns:  # an ensemble's steps, each its own plot (`model / step`)
        named = table["model"].astype(str) + " / " + table["step"].astype(str)
        table = table.assign(model=named.where(table["step"] != "", table["model"]))
    in_order = "step" not in table.columns  # else the table's order: the steps' own
    for model, g in table.groupby("model", dropna=False, sort=in_order, observed=True):
        batches = sorted(g["batch_size"].dropna().unique())
        order = g.sort_values(["idx"]).drop_duplicates("name")
        names = list(order["name"])
        pos = {n: i for i, n in enumerate(names)}
        n_b = max(1, len(batches))
        cmap = _type_colors(pd.Series([str(b) for b in batches] or ["-"]))
        parts = [(b, g[g["batch_size"] == b]) for b in batches] or [(None, g)]
        if len(names) * n_b > MAX_BARS:
            fig, ax = _fig(9.0, 4.2)
            for b, part in parts:
                part = part.assign(pos=part["name"].map(pos)).sort_values("pos")
                color = cmap[str(b) if b is not None else "-"]
                ax.plot(part["pos"], part["latency_ms"], ".-", lw=1, ms=3,
                        label=_batch_label(b), color=color)  # fmt: skip
            ax.set_xlabel("layer index (execution order; the table names each layer)")
            ax.set_ylabel("latency (ms)")
        else:
            fig, ax = _fig(7.5, max(2.5, (0.12 * n_b + 0.1) * len(names) + 1))
            height = 0.8 / n_b
            for j, (b, part) in enumerate(parts):
                y = np.array([pos[n] for n in part["name"]]) + (j - (n_b - 1) / 2) * height
                color = cmap[str(b) if b is not None else "-"]
                ax.barh(y, part["latency_ms"], height=height, label=_batch_label(b), color=color)
            ax.set_yticks(
                range(len(names)),
                [f"{i} {_short(n)}" for i, n in zip(order["idx"], names, strict=True)],
                fontsize=7,
            )
            ax.invert_yaxis()
            ax.set_xlabel("latency (ms)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_title(f"A3: layer latency, {model}")
        out.append(_png(fig))
    return out


def _batch_label(batch: object) -> str:
    return f"batch {fmt_value(batch)}" if batch is not None else "-"


def _short(name: str, width: int = 40) -> str:
    """A label cut to `width` characters, marked with an ellipsis where cut."""
    return name if len(name) <= width else name[: width - 1] + "\u2026"


def _type_colors(types: pd.Series) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {t: cmap(i % 20) for i, t in enumerate(sorted(types.unique()))}


def plot_latency_by_type(res: AnalysisResult) -> list[str]:
    out = []
    for model, g in res.table.groupby("model", observed=True):
        # a model without a batch dimension (no batch size) is the bar "-"
        g = g.assign(batch_size=g["batch_size"].fillna(0))
        wide = g.pivot_table(
            index="batch_size", columns="type", values="latency_ms", aggfunc="sum", observed=True
        ).fillna(0.0)
        fig, ax = _fig()
        bottom = np.zeros(len(wide))
        colors = _type_colors(pd.Series(wide.columns))
        bars = [str(int(b)) if b else "-" for b in wide.index]
        for t in wide.columns:
            ax.bar(bars, wide[t], bottom=bottom, label=t, color=colors[t])
            bottom += wide[t].to_numpy()
        ax.set_xlabel("batch size")
        ax.set_ylabel("summed layer latency (ms)")
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"A6: latency by layer type, {model}")
        out.append(_png(fig))
    return out


def plot_roofline(res: AnalysisResult) -> list[str]:
    """One roofline per machine (distinct peaks), with the points measured on it."""
    df = res.table.dropna(subset=["arithmetic_intensity", "arithmetic_throughput_gflops"])
    df = df[(df["arithmetic_intensity"] > 0) & (df["arithmetic_throughput_gflops"] > 0)]
    peaks = pd.DataFrame(res.extra.get("peaks", []))
    if df.empty or peaks.empty:
        return []
    df = df.merge(peaks, on=["model", "batch_size"], how="left")
    roofs = df[[schema.PEAK_FLOPS_PER_S, schema.PEAK_DRAM_BYTES_PER_S]].astype(float).fillna(-1.0)
    out = []
    for (pf, bw), g in df.groupby(
        [roofs[schema.PEAK_FLOPS_PER_S], roofs[schema.PEAK_DRAM_BYTES_PER_S]], observed=True
    ):
        fig, ax = _fig(7.5, 4.2)
        lo = min(g["arithmetic_intensity"].min(), 0.01) / 2
        hi = max(g["arithmetic_intensity"].max(), pf / bw if pf > 0 else 1.0) * 4
        source = str(g[schema.PEAK_SOURCE].iloc[0]) if pf > 0 else "no peaks recorded"
        if pf > 0 and bw > 0:
            x = np.logspace(np.log10(lo), np.log10(hi), 200)
            ax.plot(
                x,
                np.minimum(pf, x * bw) / 1e9,
                "k-",
                lw=1.5,
                label=f"roof: {pf / 1e9:.4g} GFLOP/s, {bw / 1e9:.4g} GB/s",
            )
            for level, level_bw in _cache_roofs(res, g).items():
                ax.plot(
                    x,
                    np.minimum(pf, x * level_bw) / 1e9,
                    ":",
                    lw=1.0,
                    label=f"{level} roof: {level_bw / 1e9:.4g} GB/s",
                )
        by = "type" if "type" in g.columns else "layer"
        labels = g[by].fillna("-").astype(str)
        colors = _type_colors(labels)
        for t, part in g.groupby(labels, observed=True):
            ax.scatter(
                part["arithmetic_intensity"],
                part["arithmetic_throughput_gflops"],
                s=28,
                color=colors[t],
                label=t,
                alpha=0.8,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("GFLOP/s")
        est = ", estimated FLOPs/bytes" if g["estimated"].any() else ""
        models = ", ".join(sorted(g["model"].astype(str).unique()))
        ax.set_title(f"{res.key}: {models} ({source}{est})", fontsize=10)
        ax.legend(fontsize=7, ncol=2)
        out.append(_png(fig))
    return out


def _cache_roofs(res: AnalysisResult, points: pd.DataFrame) -> dict[str, float]:
    """The cache levels' roofs recorded for the first model/batch among `points` that has
    them (A14 where traces recorded cache roofs), by level; none elsewhere."""
    have = {(r["model"], r["batch_size"]): r for r in res.extra.get("cache_roofs", [])}
    for key in zip(points["model"], points["batch_size"], strict=True):
        if key in have:
            roofs = have[key][schema.PEAK_CACHE_BYTES_PER_S]
            return {k: float(v) for k, v in roofs.items() if k != "DRAM"}
    return {}


def plot_live(res: AnalysisResult) -> list[str]:
    # the phases that add up to the client's latency, then the backend's work after the
    # response (hatched: not part of it); backend_response is the relay's view of the same time
    df = res.table[~res.table["phase"].isin(["client_total", "backend_response"])]
    if "step" in df.columns:  # an ensemble's step rows split time its whole rows hold
        df = df[(df["step"] == "") & ~df["phase"].isin(ensemble_steps.GAP_PHASES)]
    wide = df.pivot_table(
        index="model", columns="phase", values="mean_ms", aggfunc="sum", observed=True
    )
    wide = wide[[c for c in df["phase"].unique() if c in wide.columns]].fillna(0.0)
    fig, ax = _fig(7.5, max(2.2, 0.6 * len(wide) + 1.2))
    left = np.zeros(len(wide))
    for phase in wide.columns:
        after = phase == "server_after_response"
        ax.barh(
            list(wide.index), wide[phase], left=left, label=phase + (" (apart)" if after else ""),
            hatch="//" if after else None, color="#ccc" if after else None,
            edgecolor="#666" if after else None,
        )  # fmt: skip
        left += wide[phase].to_numpy()
    ax.set_xlabel("mean latency (ms)")
    # Below the axes, so that it never covers a bar.
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.set_title("live request breakdown (mean per phase)")
    return [_png(fig)]


def plot_time_breakdown(res: AnalysisResult) -> list[str]:
    df = res.table
    labels = [f"{m} b{fmt_value(b)}" for m, b in zip(df["model"], df["batch_size"], strict=True)]
    fig, ax = _fig()
    left = np.zeros(len(df))
    for col, color in (("kernel_pct", "#2a7"), ("non_kernel_pct", "#e93"), ("idle_pct", "#bbb")):
        ax.barh(labels, df[col], left=left, label=col.replace("_pct", ""), color=color)
        left += df[col].to_numpy()
    ax.set_xlabel("% of model time (K run timeline)")
    ax.legend(fontsize=8)
    ax.set_title("model time breakdown")
    return [_png(fig)]


def plot_comparison(res: AnalysisResult) -> list[str]:
    a, b = res.extra.get("labels", ["base", "new"])
    df = res.table
    fig, ax = _fig(7.5, max(2.5, 0.35 * len(df) + 1))
    y = np.arange(len(df))
    ax.barh(y - 0.2, df[f"{a}_ms"], height=0.4, label=a)
    ax.barh(y + 0.2, df[f"{b}_ms"], height=0.4, label=b)
    ax.set_yticks(y, list(df["type"]), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("summed layer latency (ms)")
    ax.legend(fontsize=8)
    ax.set_title("comparison: latency by layer type")
    return [_png(fig)]


PLOTS: dict[str, Callable[[AnalysisResult], list[str]]] = {
    "A1": plot_batch_curve,
    "A3": plot_layer_latency,
    "A6": plot_latency_by_type,
    "A9": plot_roofline,
    "A14": plot_roofline,
    "live_breakdown": plot_live,
    "time_breakdown": plot_time_breakdown,
    "comparison": plot_comparison,
}


def html_table(df: pd.DataFrame) -> str:
    shown = df.head(MAX_HTML_ROWS)
    numeric = [
        pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
        for c in df.columns
    ]
    head = "".join(f"<th>{_breakable(str(c))}</th>" for c in df.columns)
    body = []
    for row in shown.itertuples(index=False):
        cells = "".join(
            f"<td{' class=n' if n else ''}>{html.escape(fmt_value(v))}</td>"
            for v, n in zip(row, numeric, strict=True)
        )
        body.append(f"<tr>{cells}</tr>")
    more = len(df) - len(shown)
    tail = f"<p class=note>... {more} more rows (CSV/JSON carry all)</p>" if more else ""
    return f"<div class=tw><table><tr>{head}</tr>{''.join(body)}</table></div>{tail}"


def _breakable(header: str) -> str:
    """A column name that may wrap after its underscores (`arithmetic_<wbr>intensity`), so
    that a wide table (A15) fits the page instead of running off it."""
    return html.escape(header).replace("_", "_<wbr>")


def front_html(front: Front) -> list[str]:
    """The findings (and the damaged rows skipped) as the first sections of the page."""
    parts: list[str] = []
    if front.findings is None:
        pass
    elif not front.findings:
        parts.append(
            "<section id='findings'><h2>Findings</h2>"
            "<p class=note>none: no rule's threshold was crossed</p></section>"
        )
    else:
        parts.append("<section id='findings'><h2>Findings</h2>")
        parts.append("<ol class=findings>")
        for f in front.findings:
            parts.append(
                f"<li><b>{html.escape(f.finding)}</b><br><span class=ev>evidence: "
                f"{html.escape(f.evidence)}</span><br><span class=act>action: "
                f"{html.escape(f.action)}</span></li>"
            )
        parts.append("</ol></section>")
    if front.skipped:
        rows = list(front.skipped)
        parts.append(
            "<section id='skipped_rows'><h2>Skipped rows</h2>"
            f"<p class=status>{html.escape(damage.summary(rows))}</p>"
            f"{html_table(damage.frame(rows))}</section>"
        )
    return parts


def render_html(
    results: Mapping[str, AnalysisResult],
    meta: Mapping[str, Any],
    plots: bool = True,
    front: Front | None = None,
) -> str:
    front = front or Front()
    keys = [
        *(["findings"] if front.findings is not None else []),
        *(["skipped_rows"] if front.skipped else []),
        *results,
    ]
    nav = " ".join(f"<a href='#{html.escape(k)}'>{html.escape(k)}</a>" for k in keys)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>xsp-sidecar trace report</title>",
        f"<style>{CSS}</style></head><body><h1>xsp-sidecar trace report</h1>",
        "<div class=tw><table>"
        + "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
            for k, v in meta.items()
        )
        + "</table></div>",
        f"<nav>{nav}</nav>",
        *front_html(front),
    ]
    statuses = status_lines(results)
    for key, res in results.items():
        title = html.escape(headline(res))
        if res.estimated:
            title = title.replace("(estimated)", "<span class=est>(estimated)</span>")
        parts.append(f"<section id='{html.escape(key)}'><h2>{title}</h2>")
        if not res.ok:
            st = statuses[key]
            text = html.escape(st.line)
            if st.same_as is not None:
                ref = html.escape(st.same_as)
                text = text.replace(ref, f"<a href='#{ref}'>{ref}</a>")
            if st.also:  # the analyses the same reason holds for, as links
                links = ", ".join(
                    f"<a href='#{html.escape(k)}'>{html.escape(label(k))}</a>" for k in st.also
                )
                text = text.removesuffix(html.escape(same_for(st.also)))
                text += f" (the same for {links})"
            parts.append(f"<p class=status>{text}</p></section>")
            continue
        if plots and key in PLOTS and not res.table.empty:
            for uri in PLOTS[key](res):
                parts.append(f"<img alt='{html.escape(key)} plot' src='{uri}'>")
        if "summary" in res.tables:
            parts.append(html_table(res.tables["summary"]))
        table, notes = for_display(key, res)
        parts.append(html_table(table))
        for name, extra in res.tables.items():
            if name != "summary":
                parts.append(f"<h3>{html.escape(name)}</h3>{html_table(extra)}")
        for note in notes:
            parts.append(f"<p class=note>note: {html.escape(note)}</p>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)
