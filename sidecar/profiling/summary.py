"""Readable and JSON summaries of a profile: latency per level with overhead, top layers,
layer-type shares (XSP A1, A3, A5)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.profiling.experiment import LeveledProfile
from sidecar.profiling.stats import BatchDecision
from sidecar.trace import schema
from sidecar.trace.spans import Level

NAME_WIDTH = 48  # layer names longer than this are cut (marked with an ellipsis)


def cut(text: str, width: int) -> str:
    """`text` in at most `width` characters, ending in an ellipsis where it was cut."""
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def fused_ops(attributes: dict[str, Any]) -> str:
    """`Conv+Relu` for a layer that computes several original graph nodes, else ""."""
    kinds = attributes.get(schema.ORIGINAL_OP_TYPES) or []
    return "+".join(str(k) for k in kinds) if len(kinds) > 1 else ""


def layer_type_shares(result: LeveledProfile) -> list[tuple[str, float]]:
    """(op type, share of summed layer time), largest first."""
    totals: dict[str, int] = {}
    for span in result.spans_at(Level.LAYER):
        op = str(span.attributes.get(schema.OP_TYPE, span.kind))
        totals[op] = totals.get(op, 0) + int(span.duration_ns or 0)
    whole = sum(totals.values()) or 1
    return sorted(((k, v / whole) for k, v in totals.items()), key=lambda kv: -kv[1])


def as_dict(result: LeveledProfile, top: int = 10) -> dict[str, Any]:
    """JSON-safe summary of one profile."""
    layers = sorted(result.spans_at(Level.LAYER), key=lambda s: -int(s.duration_ns or 0))
    model_ns = result.stats(Level.MODEL).trimmed_mean_ns
    return {
        "trace_id": result.trace.trace_id,
        "model": result.trace.model,
        "batch_size": result.trace.batch_size,
        "runtime": result.trace.runtime,
        "device": result.trace.device,
        schema.KERNEL_LEVEL: result.trace.attributes.get(schema.KERNEL_LEVEL),
        schema.LAYER_NAMES: result.trace.attributes.get(schema.LAYER_NAMES),
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
                schema.OP_TYPE: s.attributes.get(schema.OP_TYPE, s.kind),
                "fused": fused_ops(s.attributes),
                schema.ORIGINAL_NODES: list(s.attributes.get(schema.ORIGINAL_NODES) or []),
                "ms": (s.duration_ns or 0) / 1e6,
                "flops": s.attributes.get(schema.FLOPS),
            }
            for s in layers[:top]
        ],
        "layer_types": [{schema.OP_TYPE: k, "share": v} for k, v in layer_type_shares(result)],
        "kernel_spans": len(result.spans_at(Level.KERNEL)),
    }


def render(result: LeveledProfile, top: int = 10) -> str:
    """A few readable lines about one profile."""
    d = as_dict(result, top)
    lines = [
        f"{d['model']}  batch={d['batch_size']}  {d['runtime']}  on {d['device']}",
        f"trace {d['trace_id']}  layer names: {d[schema.LAYER_NAMES]}",
        "",
        f"  {'level':<8}{'latency ms':>12}{'median ms':>12}{'overhead':>10}",
    ]
    for level, s in d["levels"].items():
        lines.append(
            f"  {level:<8}{s['trimmed_mean_ms']:>12.3f}{s['median_ms']:>12.3f}"
            f"{s['overhead_ratio']:>9.2f}x"
        )
    if "kernel" not in d["levels"]:
        lines.append(f"  kernel  {d[schema.KERNEL_LEVEL]}")
    if d["throughput_per_s"]:
        lines.append(f"  throughput {d['throughput_per_s']:.1f} inputs/s (model level)")
    if d["top_layers"]:
        tops = d["top_layers"]
        types = [t["fused"] or str(t[schema.OP_TYPE]) for t in tops]
        nw = min(NAME_WIDTH, max(len("layer"), *(len(t["name"]) for t in tops)))
        tw = max(len("type"), *(len(t) for t in types))
        lines += [
            "",
            "  top layers (L run, trimmed mean)",
            f"  {'layer':<{nw}}  {'type':<{tw}}{'ms':>9}  {'est. GFLOP':>10}",
        ]
        for t, kind in zip(tops, types, strict=True):
            gf = f"{t['flops'] / 1e9:.4f}" if t["flops"] is not None else "-"
            lines.append(f"  {cut(t['name'], nw):<{nw}}  {kind:<{tw}}{t['ms']:>9.3f}  {gf:>10}")
        fused = [t for t in tops if t["fused"]]
        if fused:
            lines.append("  fused layers compute these graph nodes:")
            lines += [f"    {t['name']}: {', '.join(t[schema.ORIGINAL_NODES])}" for t in fused]
        lines += ["", "  layer type shares"]
        for t in d["layer_types"][:top]:
            lines.append(f"  {t[schema.OP_TYPE]!s:<24}{t['share'] * 100:>6.1f}%")
    if d["kernel_spans"]:
        lines.append(f"\n  kernel spans: {d['kernel_spans']}")
    return "\n".join(lines)


def render_sweep(
    latency_ms: Sequence[tuple[int, float]], decision: BatchDecision, notes: Sequence[str] = ()
) -> str:
    """Batch sweep table (XSP A1) with the optimal batch decision (`stats.decide_batch`) and
    `notes` below it (how many rounds it took, what to run next)."""
    lines = ["", f"  {'batch':>6}{'latency ms':>12}{'inputs/s':>12}"]
    for batch, ms in latency_ms:
        lines.append(f"  {batch:>6}{ms:>12.3f}{batch / (ms / 1e3):>12.1f}")
    if decision.status == "decided":
        lines.append(f"  optimal batch size: {decision.optimal} ({decision.reason})")
    else:
        word = "not yet known" if decision.status == "not_yet_known" else "uncertain"
        lines.append(f"  optimal batch size: {word}: {decision.reason}")
    lines += [f"  {note}" for note in notes]
    return "\n".join(lines)
