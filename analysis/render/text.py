"""Render a report (analysis results) as plain text, Markdown, JSON or CSV files."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.analyses.common import AnalysisResult
from analysis.findings import Finding
from analysis.findings import table as findings_table
from analysis.load import damage
from analysis.load.damage import BadRow
from analysis.render import jsontext
from sidecar.profiling.gpu.demangle import short_name

MAX_ROWS = 40  # per table in text / Markdown; JSON and CSV carry every row
MAX_SKIPPED = 20  # damaged rows named in text / Markdown / HTML; JSON and CSV carry all


KERNEL_NAME_TABLES = ("A8", "A9", "A10")  # their `name` column is a kernel name
SHORT_NAMES_NOTE = (
    "kernel names shortened (template arguments and parameters dropped: <…>); the JSON and "
    "CSV outputs carry the full demangled names"
)


def for_display(key: str, res: AnalysisResult) -> tuple[pd.DataFrame, list[str]]:
    """The table and notes as text and HTML show them: kernel names in their short form
    (`at::native::vectorized_elementwise_kernel<…>`); JSON and CSV keep the full names."""
    df, notes = res.table, list(res.notes)
    if key not in KERNEL_NAME_TABLES or "name" not in df.columns or df.empty:
        return df, notes
    short = df["name"].map(lambda n: short_name(str(n)) if isinstance(n, str) else n)
    if not short.equals(df["name"]):
        df = df.assign(name=short)
        notes.append(SHORT_NAMES_NOTE)
    return df, notes


@dataclass
class Front:
    """What a report shows before the analyses: findings, and the damaged rows skipped."""

    findings: Sequence[Finding] | None = None  # None: not part of this output (compare)
    skipped: Sequence[BadRow] = field(default_factory=list)


def fmt_value(value: Any) -> str:
    """Numbers to 4 significant digits (integers whole), missing values as '-'."""
    if value is None or value is pd.NA:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (hasattr(value, "dtype") and str(value.dtype).startswith("int")):
        return str(int(value))
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.4g}"
    return str(value)


def _cells(df: pd.DataFrame, max_rows: int) -> tuple[list[str], list[list[str]], int]:
    shown = df.head(max_rows)
    header = [str(c) for c in df.columns]
    rows = [[fmt_value(v) for v in row] for row in shown.itertuples(index=False)]
    return header, rows, len(df) - len(shown)


def text_table(df: pd.DataFrame, max_rows: int = MAX_ROWS, indent: str = "  ") -> str:
    header, rows, more = _cells(df, max_rows)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    numeric = [
        pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
        for c in df.columns
    ]

    def line(cells: list[str]) -> str:
        return (
            indent
            + "  ".join(
                c.rjust(w) if num else c.ljust(w)
                for c, w, num in zip(cells, widths, numeric, strict=True)
            ).rstrip()
        )

    out = [line(header), indent + "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    if more:
        out.append(f"{indent}... {more} more rows (use --format csv or json for all)")
    return "\n".join(out)


def markdown_table(df: pd.DataFrame, max_rows: int = MAX_ROWS) -> str:
    header, rows, more = _cells(df, max_rows)

    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    numeric = [
        pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
        for c in df.columns
    ]
    out = [
        "| " + " | ".join(esc(h) for h in header) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    if more:
        out.append(f"\n*... {more} more rows (use `--format csv` or `json` for all)*")
    return "\n".join(out)


def headline(res: AnalysisResult) -> str:
    title = f"{label(res.key)}: {res.title}"
    if res.estimated:
        title += " (estimated)"
    return title


def _status_line(res: AnalysisResult) -> str:
    word = {
        "not_captured": "NOT CAPTURED",
        "empty": "NO DATA",
        "not_applicable": "NOT APPLICABLE",
        "error": "ERROR",
    }.get(res.status, res.status)
    return f"{word}: {res.reason}"


def label(key: str) -> str:
    """How a report names an analysis: `A8`, `time breakdown`."""
    return key if key.startswith("A") else key.replace("_", " ")


@dataclass(frozen=True)
class Status:
    """What a report says for an analysis without data."""

    line: str  # the whole line, e.g. `NOT CAPTURED: same reason as A8`
    same_as: str | None = None  # the analysis that gave this reason in full
    also: tuple[str, ...] = ()  # the later analyses without data for the same reason


def same_for(keys: Sequence[str]) -> str:
    return f" (the same for {', '.join(label(k) for k in keys)})" if keys else ""


def status_lines(results: Mapping[str, AnalysisResult]) -> dict[str, Status]:
    """Per analysis without data: its status line, or (when an earlier analysis gave the
    same reason) a short line naming that earlier analysis. A reason is said once, in full,
    where it first appears, with the list of the other analyses it holds for."""
    first: dict[str, str] = {}
    out: dict[str, Status] = {}
    for key, res in results.items():
        if res.ok:
            continue
        line = _status_line(res)
        earlier = next((prev for prev in first if line.startswith(prev)), None)
        if earlier is not None:  # the same reason, perhaps with a remark added
            word, rest = line.split(":", 1)[0], line[len(earlier) :].strip()
            short = f"{word}: same reason as {first[earlier]}" + (f" {rest}" if rest else "")
            out[key] = Status(short, first[earlier])
        else:
            first[line] = key
            out[key] = Status(line)
    for key, status in out.items():
        also = tuple(k for k, st in out.items() if st.same_as == key)
        if also:
            out[key] = Status(status.line + same_for(also), None, also)
    return out


def front_text(front: Front, markdown: bool = False) -> list[str]:
    """The findings and the skipped-rows note as text or Markdown lines."""
    out: list[str] = []
    if front.findings is not None:
        out += ["", "## Findings", ""] if markdown else ["", "findings", "--------"]
        if not front.findings:
            out.append("None." if markdown else "  none: no rule's threshold was crossed")
    for i, f in enumerate(front.findings or (), 1):
        if markdown:
            out += [
                f"{i}. **{f.finding}**",
                f"   - evidence: {f.evidence}",
                f"   - action: {f.action}",
            ]
        else:
            out += [
                f"  {i}. {f.finding}",
                f"     evidence: {f.evidence}",
                f"     action: {f.action}",
            ]
    if front.skipped:
        rows = list(front.skipped)
        more = len(rows) - MAX_SKIPPED
        if markdown:
            out += ["", "## Skipped rows", "", f"**{damage.summary(rows)}**:", ""]
            out += [f"- {damage.describe(r)}" for r in rows[:MAX_SKIPPED]]
            if more > 0:
                out.append(f"- ... and {more} more (`--format json` or `csv` lists all)")
        else:
            out += ["", "skipped rows", "------------", f"  {damage.summary(rows)}:"]
            out += [f"  - {damage.describe(r)}" for r in rows[:MAX_SKIPPED]]
            if more > 0:
                out.append(f"  ... and {more} more (--format json or csv lists all)")
    return out


def render_text(
    results: Mapping[str, AnalysisResult],
    meta: Mapping[str, Any],
    markdown: bool = False,
    front: Front | None = None,
) -> str:
    """The whole report as plain text or Markdown: meta, findings, skipped rows, analyses."""
    out: list[str] = []
    if markdown:
        out.append("# xsp-sidecar trace report\n")
        out += [f"- **{k}**: {v}" for k, v in meta.items()]
    else:
        out.append("xsp-sidecar trace report")
        out.append("=" * 24)
        out += [f"{k}: {v}" for k, v in meta.items()]
    out += front_text(front or Front(), markdown)
    statuses = status_lines(results)
    for key, res in results.items():
        out.append("")
        if markdown:
            out.append(f"## {headline(res)}\n")
        else:
            out.append(headline(res))
            out.append("-" * len(headline(res)))
        if not res.ok:
            line = statuses[key].line
            out.append(f"**{line}**" if markdown else "  " + line)
            continue
        if "summary" in res.tables:
            out.append(_table(res.tables["summary"], markdown))
            out.append("")
        table, notes = for_display(key, res)
        out.append(_table(table, markdown))
        for name, extra in res.tables.items():
            if name != "summary":
                label = f"**{name}**\n" if markdown else f"  {name}:"
                out += ["", label, _table(extra, markdown)]
        for note in notes:
            out.append(f"\n> note: {note}" if markdown else f"  note: {note}")
    return "\n".join(out) + "\n"


def _table(df: pd.DataFrame, markdown: bool) -> str:
    return markdown_table(df) if markdown else text_table(df)


def render_json(
    results: Mapping[str, AnalysisResult], meta: Mapping[str, Any], front: Front | None = None
) -> str:
    front = front or Front()
    doc: dict[str, Any] = {"meta": dict(meta)}
    if front.findings is not None:
        doc["findings"] = [f.to_json() for f in front.findings]
    doc["skipped_rows"] = damage.as_json(list(front.skipped))
    for key, res in results.items():
        doc[key] = res.to_json()
    return jsontext.dumps(doc, indent=1, default=str)


def write_csv(
    results: Mapping[str, AnalysisResult], out_dir: Path, front: Front | None = None
) -> list[Path]:
    """One CSV per analysis (and per secondary table); analyses without data get none.
    `findings.csv` always, `skipped_rows.csv` when damaged rows were skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    front = front or Front()
    written = []
    extra = {} if front.findings is None else {"findings": findings_table(front.findings)}
    if front.skipped:
        extra["skipped_rows"] = damage.frame(front.skipped)
    for name, table in extra.items():
        path = out_dir / f"{name}.csv"
        table.to_csv(path, index=False)
        written.append(path)
    for key, res in results.items():
        if not res.ok:
            continue
        for name, table in {
            key: res.table,
            **{f"{key}_{n}": t for n, t in res.tables.items()},
        }.items():
            path = out_dir / f"{name}.csv"
            table.to_csv(path, index=False)
            written.append(path)
    return written
