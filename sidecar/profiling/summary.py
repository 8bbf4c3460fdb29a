"""Readable and JSON summaries of a profile: latency per level with overhead, top layers,
layer-type shares (XSP A1, A3, A5)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.profiling.experiment import ProfileResult
from sidecar.trace.spans import Level


def layer_type_shares(result: ProfileResult) -> list[tuple[str, float]]:
    """(op type, share of summed layer time), largest first."""
    totals: dict[str, int] = {}
    for span in result.spans_at(Level.LAYER):
        op = str(span.attributes.get("op_type", span.kind))
        totals[op] = totals.get(op, 0) + int(span.duration_ns or 0)
    whole = sum(totals.values()) or 1
    return sorted(((k, v / whole) for k, v in totals.items()), key=lambda kv: -kv[1])


def as_dict(result: ProfileResult, top: int = 10) -> dict[str, Any]:
    """JSON-safe summary of one profile."""
    layers = sorted(result.spans_at(Level.LAYER), key=lambda s: -int(s.duration_ns or 0))
    model_ns = result.stats(Level.MODEL).trimmed_mean_ns
    return {
        "trace_id": result.trace.trace_id,
        "model": result.trace.model,
        "batch_size": result.trace.batch_size,
        "runtime": result.trace.runtime,
        "device": result.trace.device,
        "kernel_level": result.trace.attributes.get("kernel_level"),
        "layer_names": result.trace.attributes.get("layer_names"),
        "levels": {
            s.level.value: {
                "trimmed_mean_ms": s.trimmed_mean_ns / 1e6,
                "median_ms": s.median_ns / 1e6,
                "overhead_ratio": s.overhead_ratio,
                "iterations": s.iterations,
            }
            for s in result.level_stats
        },
        "throughput_per_s": (result.trace.batch_size or 1) / (model_ns / 1e9) if model_ns else None,
        "top_layers": [
            {
                "name": s.name,
                "op_type": s.attributes.get("op_type", s.kind),
                "ms": (s.duration_ns or 0) / 1e6,
                "flops": s.attributes.get("flops"),
            }
            for s in layers[:top]
        ],
        "layer_types": [{"op_type": k, "share": v} for k, v in layer_type_shares(result)],
        "kernel_spans": len(result.spans_at(Level.KERNEL)),
    }


def render(result: ProfileResult, top: int = 10) -> str:
    """A few readable lines about one profile."""
    d = as_dict(result, top)
    lines = [
        f"{d['model']}  batch={d['batch_size']}  {d['runtime']}  on {d['device']}",
        f"trace {d['trace_id']}  layer names: {d['layer_names']}",
        "",
        f"  {'level':<8}{'latency ms':>12}{'median ms':>12}{'overhead':>10}",
    ]
    for level, s in d["levels"].items():
        lines.append(
            f"  {level:<8}{s['trimmed_mean_ms']:>12.3f}{s['median_ms']:>12.3f}"
            f"{s['overhead_ratio']:>9.2f}x"
        )
    if "kernel" not in d["levels"]:
        lines.append(f"  kernel  {d['kernel_level']}")
    if d["throughput_per_s"]:
        lines.append(f"  throughput {d['throughput_per_s']:.1f} inputs/s (model level)")
    if d["top_layers"]:
        lines += ["", f"  top layers (L run, trimmed mean){'':>8}ms     est. GFLOP"]
        for t in d["top_layers"]:
            gf = f"{t['flops'] / 1e9:.4f}" if t["flops"] is not None else "-"
            lines.append(
                f"  {t['name'][:36]:<36} {str(t['op_type'])[:14]:<14}{t['ms']:>8.3f}  {gf:>10}"
            )
        lines += ["", "  layer type shares"]
        for t in d["layer_types"][:top]:
            lines.append(f"  {t['op_type']!s:<24}{t['share'] * 100:>6.1f}%")
    if d["kernel_spans"]:
        lines.append(f"\n  kernel spans: {d['kernel_spans']}")
    return "\n".join(lines)


def render_sweep(latency_ms: Sequence[tuple[int, float]], optimal: int) -> str:
    """Batch sweep table (XSP A1) with the optimal batch."""
    lines = ["", f"  {'batch':>6}{'latency ms':>12}{'inputs/s':>12}"]
    for batch, ms in latency_ms:
        lines.append(f"  {batch:>6}{ms:>12.3f}{batch / (ms / 1e3):>12.1f}")
    if optimal == latency_ms[-1][0]:
        lines.append(
            f"  optimal batch size: >= {optimal} (throughput still rises by more than 5% "
            "per doubling up to the largest batch measured)"
        )
    else:
        lines.append(f"  optimal batch size: {optimal} (doubling it raises throughput by <= 5%)")
    return "\n".join(lines)
