"""xsp-sidecar trace report: XSP's analyses A1-A15 and more over one or more trace stores.

    python analysis/report.py traces.db [more.db ...] [filters] [--format F] [--out DIR]
    python analysis/report.py compare traces.db [...] --base SEL --new SEL
    python analysis/report.py timeline TRACE_ID traces.db [...] -o trace.json
    python analysis/report.py export-parquet pod-*.db --out fleet/
    python analysis/report.py fleet fleet/ [--top N] [--format text|json] [--out DIR]

A thin command line over `analysis.trace_analysis.TraceAnalysis`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run by its path (`python analysis/report.py`), this file belongs to no package, and Python
# puts analysis/ itself on sys.path, not the folder that holds it. Import the package this file
# sits in, from there (not another `analysis` the environment may hold), under its own name,
# so that `import analysis.x` finds its modules; sys.path stays as it is.
if __name__ == "__main__" and not __package__ and "analysis" not in sys.modules:
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "analysis", Path(__file__).resolve().with_name("__init__.py")
    )
    assert _spec is not None and _spec.loader is not None
    sys.modules["analysis"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["analysis"])

if __name__ == "__main__" and sys.argv[1:2] == ["export-parquet"]:
    # the export needs neither pandas nor the analyses: start without them (0.3 s)
    import analysis._extra
    from analysis.fleet import export as fleet_export

    raise SystemExit(fleet_export.main(sys.argv[2:]))

import argparse
import json
import textwrap
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import analysis._extra  # noqa: F401  (first: one line, not a traceback, without the extra)
from analysis.fleet import export as fleet_export
from analysis.keys import ANALYSIS_KEYS
from analysis.load import columnar, damage
from analysis.load.store_file import TraceDatabaseError
from analysis.load.trace_filter import TraceFilter, TraceNotFoundError, parse_since
from sidecar.trace import schema

# The analyses (pandas and all) are imported once the command line is read and the first
# store's spans are being read (`run`): their import then runs beside the reads.
if TYPE_CHECKING:
    from analysis.analyses.common import AnalysisResult
    from analysis.render.text import Front
    from analysis.trace_analysis import TraceAnalysis


class UsageError(Exception):
    """The command line asks for something impossible; exit status 2."""


COMMANDS = ("report", "compare", "timeline", "export-parquet", "fleet")
FORMATS = ("text", "markdown", "html", "json", "csv")
EXTENSIONS = {"text": "txt", "markdown": "md", "html": "html", "json": "json"}
SELECTOR_HELP = (
    "KEY=VALUE[,KEY=VALUE...] with KEY in model, version, batch_size, device, runtime, "
    "source (database path or its tail), trace (id prefix); VALUE may list alternatives "
    "with '|'"
)
EPILOG = """\
commands:
  report (default)  all analyses: XSP A1-A15, fidelity, live_breakdown, overhead,
                    time_breakdown and, with --base/--new or exactly two databases, comparison
  compare           only the comparison of two trace sets (HTA TraceDiff-style)
  timeline          one trace as Chrome/Perfetto trace-event JSON (open in ui.perfetto.dev)
  export-parquet    many pods' stores as Parquet files (DuckDB, Spark, Trino read them)
  fleet             per-model fleet analyses over such an export, in DuckDB

examples:
  report.py traces.db
  report.py pod-a.db pod-b.db --model resnet50 --since 24h --format html --out report/
  report.py traces.db --format json --only A1,A15
  report.py compare traces.db --base model=resnet50,batch_size=1 --new model=resnet50,batch_size=8
  report.py compare before.db after.db
  report.py timeline 4bf92f35 traces.db -o trace.json
  report.py export-parquet pods/*.db --out fleet/ && report.py fleet fleet/

Run 'report.py compare --help' or 'report.py timeline --help' for their options.
"""


def _filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("dbs", nargs="+", metavar="DB", help="trace store(s); several = a fleet")
    g = p.add_argument_group("filters")
    g.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME",
        help="only this model (repeat or comma-separate for several)",
    )
    g.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="ID",
        help="only this trace id or id prefix (repeatable)",
    )
    g.add_argument(
        "--batch-size",
        action="append",
        default=[],
        metavar="N",
        help="only this batch size (repeat or comma-separate)",
    )
    g.add_argument(
        "--since",
        metavar="WHEN",
        help="only traces created since WHEN: 30m, 2h, 7d, an ISO date/time "
        "(UTC unless it has an offset) or epoch ns",
    )
    g.add_argument(
        "--include-errors",
        action="store_true",
        help="also load traces whose profile failed (status error; live_only traces are read "
        "anyway)",
    )


def _sets(p: argparse.ArgumentParser, what: str = "") -> None:
    """`--base` and `--new`: the two trace sets a comparison sets side by side."""
    p.add_argument("--base", metavar="SEL", help=f"{what}base set: {SELECTOR_HELP}")
    p.add_argument("--new", metavar="SEL", help=f"{what}new set (same syntax)")


def _outputs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text (default), markdown, html (with plots), json (keyed by A1..A15 "
        "and named analyses) or csv (one file per analysis; needs --out)",
    )
    g.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write report.<ext> (or the CSV files) into DIR instead of stdout",
    )
    g.add_argument("--no-plots", action="store_true", help="html without plots")
    g.add_argument("--top", type=int, default=15, help="comparison: layers to list (default: 15)")


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line, and its default command's parser (whose help is the top-level
    help: its filters and --format are what most runs need)."""
    parser = argparse.ArgumentParser(
        prog="report.py",
        description="Analyse xsp-sidecar trace stores: XSP's fifteen analyses (A1-A15), the "
        "replay's fidelity to the server, the live request breakdown, profiling overhead, "
        "time breakdown, comparisons and timelines.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    rep = sub.add_parser(
        "report",
        help="all analyses (the default command)",
        prog="report.py [report]",
        description=textwrap.fill(
            "Findings first (what to do, with the evidence), then XSP's fifteen analyses "
            "(A1-A15), the replay's fidelity to the server, the live request breakdown, "
            "profiling overhead, time breakdown and "
            "comparisons, over one or more xsp-sidecar trace stores. Damaged rows are "
            "skipped and named.",
            90,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _filters(rep)
    _outputs(rep)
    rep.add_argument(
        "--only",
        metavar="KEYS",
        help=f"comma-separated analyses to run, from: {', '.join(ANALYSIS_KEYS)}, comparison",
    )
    _sets(rep, "comparison ")
    cmp_ = sub.add_parser(
        "compare",
        help="compare two sets of traces",
        description="Compare two trace sets by layer type and top layers. "
        "Without --base/--new, exactly two databases are compared.",
    )
    _filters(cmp_)
    _outputs(cmp_)
    _sets(cmp_)
    tl = sub.add_parser(
        "timeline",
        help="export one trace as trace-event JSON",
        description="Write one trace as Chrome/Perfetto trace-event JSON: live "
        "spans (proxy, backend) and replay spans (leveled runs) as separate "
        "processes, one track per level.",
    )
    tl.add_argument("trace_id", metavar="TRACE_ID", help="trace id or unique prefix")
    _filters(tl)
    tl.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="output file (default: stdout)"
    )
    exp = sub.add_parser(
        "export-parquet",
        help="write trace stores as Parquet for the fleet report",
        description=fleet_export.DESCRIPTION,
    )
    fleet_export.add_arguments(exp)
    fl = sub.add_parser(
        "fleet",
        help="fleet analyses over a Parquet export, in DuckDB",
        description="Per model over every pod of an export: traces, model latency per batch "
        "size, layer type shares, top layers by time, live request breakdown, the replay's "
        "fidelity and streamed responses (JSON: per analysis its rows, and `notes`).",
    )
    fl.add_argument("fleet_dir", type=Path, metavar="DIR", help="folder of export-parquet")
    fl.add_argument("--top", type=int, default=10, help="top layers per model (default: 10)")
    fl.add_argument("--format", choices=("text", "json"), default="text")
    fl.add_argument("--out", type=Path, metavar="DIR", help="write fleet.<ext> into DIR")
    fl.add_argument("--threads", type=int, help="DuckDB threads (default: all cores)")
    return parser, rep


def run_fleet(args: argparse.Namespace) -> int:
    """`export-parquet` and `fleet`: the Parquet path (DuckDB), no pandas over all rows."""
    from analysis.analyses.common import records
    from analysis.fleet import analyses as fleet

    if args.command == "export-parquet":
        return fleet_export.run(args)
    tables = fleet.fleet_tables(args.fleet_dir, top=args.top, threads=args.threads)
    if args.format == "json":
        payload: dict[str, Any] = {k: records(df) for k, df in tables.items()}
        payload["notes"] = {k: dict(df.attrs) for k, df in tables.items() if df.attrs}
        text = json.dumps(payload, indent=1, allow_nan=False)
    else:
        text = fleet.render_text(tables)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"fleet.{'json' if args.format == 'json' else 'txt'}"
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _split(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(v.strip() for item in values for v in item.split(",") if v.strip())


def make_filter(args: argparse.Namespace) -> TraceFilter:
    try:
        batches = tuple(int(b) for b in _split(args.batch_size))
    except ValueError:
        raise UsageError(f"--batch-size wants integers, got {args.batch_size}") from None
    return TraceFilter(
        models=_split(args.model),
        trace_ids=_split(args.trace),
        batch_sizes=batches,
        since_ns=parse_since(args.since) if args.since else None,
        include_errors=args.include_errors,
    )


def _meta(ta: TraceAnalysis, args: argparse.Namespace) -> dict[str, Any]:
    t = ta.data.traces
    meta: dict[str, Any] = {
        "sources": ", ".join(ta.data.sources),
        "traces": len(t),
        "models": ", ".join(sorted(t["model"].astype(str).unique())),
        "batch_sizes": ", ".join(str(b) for b in sorted(t["batch_size"].dropna().unique())),
        "spans": ta.data.span_count(),
    }
    live = t.loc[t["status"] == "live_only", "model"].astype(str)
    if not live.empty:
        meta["live_only_traces"] = (
            f"{len(live)} (models: {', '.join(sorted(live.unique()))}): no replay can run "
            "their model; their live side is in the live breakdown"
        )
    if ta.data.skipped_errors:
        meta["failed_profiles_skipped"] = ta.data.skipped_errors
    if ta.data.bad_rows:
        meta["skipped_rows"] = damage.summary(ta.data.bad_rows)
    filters = {
        k: v
        for k, v in (
            ("model", args.model),
            ("trace", args.trace),
            ("batch_size", args.batch_size),
            ("since", args.since),
        )
        if v
    }
    if filters:
        meta["filters"] = "; ".join(
            f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in filters.items()
        )
    peaks = sorted({peak_line(a) for a in t["attributes"] if a.get(schema.PEAK_FLOPS_PER_S)})
    if peaks:
        meta["peaks"] = " | ".join(peaks)
    synthetic = sorted({str(a["synthetic"]) for a in t["attributes"] if a.get("synthetic")})
    if synthetic:
        meta["synthetic_data"] = " | ".join(synthetic)
    meta["generated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return meta


def peak_line(attrs: dict[str, Any]) -> str:
    """The roofline peak a trace recorded, and how it was measured: `cpu-microbenchmark
    182.3 GFLOP/s, 12.1 GB/s, best of 5 rounds, 2026-11-20 10:02 UTC, load 0.05/CPU`."""
    parts = [
        f"{attrs.get(schema.PEAK_SOURCE, '?')} "
        f"{float(attrs[schema.PEAK_FLOPS_PER_S]) / 1e9:.4g} GFLOP/s"
    ]
    if attrs.get(schema.PEAK_DRAM_BYTES_PER_S):
        parts.append(f"{float(attrs[schema.PEAK_DRAM_BYTES_PER_S]) / 1e9:.4g} GB/s")
    if attrs.get(schema.PEAK_ROUNDS):
        parts.append(f"best of {attrs[schema.PEAK_ROUNDS]} rounds")
    if attrs.get(schema.PEAK_MEASURED_NS):
        when = time.gmtime(int(attrs[schema.PEAK_MEASURED_NS]) / 1e9)
        parts.append(time.strftime("measured %Y-%m-%d %H:%M UTC", when))
    if attrs.get(schema.PEAK_LOAD_PER_CPU) is not None:
        parts.append(f"load {float(attrs[schema.PEAK_LOAD_PER_CPU]):.2f}/CPU")
    return ", ".join(parts)


def _comparison(ta: TraceAnalysis, args: argparse.Namespace) -> AnalysisResult:
    from analysis.analyses.common import AnalysisResult

    base, new = args.base, args.new
    if bool(base) != bool(new):
        raise UsageError("give both --base and --new (or neither)")
    if not base:
        sources = ta.data.sources
        if len(sources) != 2:
            return AnalysisResult(
                "comparison",
                "Comparison of two trace sets",
                status="not_applicable",
                reason="choose two sets with --base SEL --new SEL, or pass exactly two "
                f"databases (got {len(sources)})",
            )
        base, new = f"source={sources[0]}", f"source={sources[1]}"
        names = [Path(s).name for s in sources]
        if names[0] == names[1]:
            names = [str(Path(*Path(s).parts[-2:])) for s in sources]
        if names[0] != names[1]:
            return ta.compare(base, new, labels=(names[0], names[1]), top=args.top)
    return ta.compare(base, new, top=args.top)


def _emit(
    results: dict[str, AnalysisResult],
    meta: dict[str, Any],
    args: argparse.Namespace,
    front: Front,
) -> int:
    from analysis.render import text as render_text

    if args.format == "csv":
        if args.out is None:
            raise UsageError("--format csv writes one file per analysis: give --out DIR")
        paths = render_text.write_csv(results, args.out, front)
        print(f"wrote {len(paths)} CSV files to {args.out}", file=sys.stderr)
        return 0
    if args.format == "json":
        text = render_text.render_json(results, meta, front)
    elif args.format == "html":
        from analysis.render.html import render_html

        text = render_html(results, meta, plots=not args.no_plots, front=front)
    else:
        text = render_text.render_text(
            results, meta, markdown=args.format == "markdown", front=front
        )
    if args.out is None:
        sys.stdout.write(text)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"report.{EXTENSIONS[args.format]}"
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _warn_skipped(ta: TraceAnalysis, limit: int = 10) -> None:
    """Name the damaged rows on stderr (the report carries them too)."""
    rows = ta.data.bad_rows
    if not rows:
        return
    print(f"report.py: {damage.summary(rows)}:", file=sys.stderr)
    for row in rows[:limit]:
        print(f"  {damage.describe(row)}", file=sys.stderr)
    if len(rows) > limit:
        print(f"  ... and {len(rows) - limit} more (listed in the report)", file=sys.stderr)


def _no_match(ta: TraceAnalysis, args: argparse.Namespace) -> str:
    text = f"report.py: no trace in {', '.join(args.dbs)} matches the filters"
    if ta.data.skipped_errors:
        text += f" ({ta.data.skipped_errors} failed profiles skipped; see --include-errors)"
    return text


def _check_models(dbs: Sequence[str], models: Sequence[str]) -> None:
    """A --model that names no model of the stores is a usage error, said in one line with
    the models that exist."""
    if not models:
        return
    from analysis.load.tracedb import model_counts

    counts = model_counts(dbs)
    missing = [m for m in models if m not in counts]
    if missing:
        have = ", ".join(f"{m} ({n} traces)" for m, n in sorted(counts.items()))
        raise UsageError(
            f"no model named {', '.join(missing)} in {', '.join(dbs)}; "
            f"the stores hold: {have or 'no traces at all'}"
        )


def run(args: argparse.Namespace) -> int:
    flt = make_filter(args)
    first = columnar.SpanBatches.started(Path(args.dbs[0]), flt)  # before the analyses' import
    from analysis.render.text import Front
    from analysis.trace_analysis import ANALYSES, TraceAnalysis

    ta = TraceAnalysis.from_paths(args.dbs, flt, first)
    _check_models(args.dbs, flt.models)
    _warn_skipped(ta)
    if ta.data.empty:
        print(_no_match(ta, args), file=sys.stderr)
        return 1
    if args.command == "timeline":
        doc = ta.timeline(args.trace_id)
        text = json.dumps(doc, separators=(",", ":"))
        if args.output is None:
            sys.stdout.write(text + "\n")
        else:
            args.output.write_text(text, encoding="utf-8")
            n = sum(1 for e in doc["traceEvents"] if e["ph"] == "X")
            print(
                f"wrote {args.output}: {n} spans of trace {doc['otherData']['trace_id']}",
                file=sys.stderr,
            )
        return 0
    meta = _meta(ta, args)
    if args.command == "compare":
        front = Front(None, ta.data.bad_rows)
        return _emit({"comparison": _comparison(ta, args)}, meta, args, front)
    keys = [*ANALYSES, "comparison"]
    if args.only:
        keys = list(_split([args.only]))
        unknown = [k for k in keys if k not in ANALYSES and k != "comparison"]
        if unknown:
            raise UsageError(
                f"unknown analysis {', '.join(unknown)}; choose from "
                f"{', '.join([*ANALYSES, 'comparison'])}"
            )
    ta.prefetch(keys)  # (two at a time on a small store; the findings read them too)
    front = Front(ta.findings(), ta.data.bad_rows)
    results = {k: ta.result(k) for k in keys if k != "comparison"}
    if "comparison" in keys:
        results["comparison"] = _comparison(ta, args)
    return _emit(results, meta, args, front)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, report_parser = build_parsers()
    if not argv or argv[0] in ("-h", "--help"):
        # The default command's help: its filters and --format, then the other commands.
        report_parser.print_help(sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        argv.insert(0, "report")
    args = parser.parse_args(argv)
    try:
        if args.command in ("export-parquet", "fleet"):
            return run_fleet(args)
        return run(args)
    except (TraceDatabaseError, TraceNotFoundError, FileNotFoundError) as exc:
        print(f"report.py: {exc}", file=sys.stderr)
        return 1
    except (UsageError, ValueError) as exc:  # bad option, --since or selector
        print(f"report.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
