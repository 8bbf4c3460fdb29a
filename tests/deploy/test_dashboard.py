"""The Grafana dashboard: valid JSON for Grafana, and only metrics the contracts define."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tests.deploy.helpers import (
    DASHBOARD,
    REPO,
    contract_metrics,
    dashboard,
    dashboard_exprs,
    manifests,
    render,
)

METRIC = re.compile(r"\b(xsp_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b(xsp_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus adds when it scrapes (target labels), not exported by the sidecar.
TARGET_LABELS = {"instance", "job", "namespace", "pod"}


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _base_metric(series: str, metrics: dict[str, Any]) -> str:
    """The contract metric a series name belongs to (histogram series map to their family)."""
    if series in metrics:
        return series
    for suffix in HISTOGRAM_SUFFIXES:
        family = series.removesuffix(suffix)
        if family != series and family in metrics and metrics[family].type == "histogram":
            return family
    raise AssertionError(f"{series} is not a metric (or histogram series) in docs/contracts.md")


def test_contracts_parse_into_metrics() -> None:
    metrics = contract_metrics()
    assert metrics["xsp_request_duration_seconds"].type == "histogram"
    assert metrics["xsp_response_bytes_total"].type == "counter"  # second name on one row
    assert "grpc_code" in metrics["xsp_requests_total"].labels
    assert len(metrics) >= 20


def test_every_metric_in_dashboard_and_chart_is_in_the_contracts() -> None:
    metrics = contract_metrics()
    rendered = render({"serviceMonitor": {"enabled": True}})
    texts = [*dashboard_exprs(dashboard()), *rendered.values()]
    referenced = {m for text in texts for m in METRIC.findall(text)}
    assert referenced, "no xsp_ metric found: the scan is broken"
    for series in sorted(referenced):
        _base_metric(series, metrics)


def test_selector_labels_exist_on_their_metric() -> None:
    metrics = contract_metrics()
    for expr in dashboard_exprs(dashboard()):
        for series, matchers in SELECTOR.findall(expr):
            family = metrics[_base_metric(series, metrics)]
            allowed = (
                family.labels | TARGET_LABELS | ({"le"} if series.endswith("_bucket") else set())
            )
            for label in MATCHER.findall(matchers):
                assert label in allowed, f"{series} has no label {label!r}: {expr}"


def test_dashboard_covers_what_the_issue_asks_for() -> None:
    exprs = "\n".join(dashboard_exprs(dashboard()))
    for needed in (
        "sum by (model, protocol, grpc_code) (rate(xsp_requests_total",
        "histogram_quantile(0.99, sum by (le, model, protocol) "
        "(rate(xsp_request_duration_seconds_bucket",
        "sum by (protocol) (rate(xsp_requests_total",  # REST beside gRPC (issue 42)
        'xsp_requests_total{model=~"$model", protocol="http"',
        "sum by (reason) (rate(xsp_http_refused_total",
        "xsp_backend_phase_duration_seconds",
        "xsp_sampling_decisions_total",
        "xsp_profiles_total",
        "xsp_samples_dropped_total",
        "xsp_profiled_latency_seconds",
        "xsp_profiling_overhead_ratio",
        "xsp_layer_type_time_share",
    ):
        assert needed in exprs, needed


def test_dashboard_is_well_formed_grafana_json() -> None:
    dash = dashboard()
    assert dash["uid"] == "xsp-sidecar" and dash["title"]
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _panels(dash):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            used = set(re.findall(r"\$(\w+)", t["expr"]))
            assert used <= set(variables) | {"__rate_interval", "__range"}, t["expr"]


def test_the_chart_holds_the_only_copy() -> None:
    """dashboards/xsp-sidecar.json in the chart is the one source; a second copy would drift."""
    copies = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in {"node_modules", "build"}]
        for name in files:
            path = Path(root) / name
            if (
                name.endswith(".json")
                and path != DASHBOARD
                and path.stat().st_size < 5_000_000
                and '"uid": "xsp-sidecar"' in path.read_text(errors="replace")
            ):
                copies.append(path)
    assert copies == [], f"copies of the dashboard outside the chart: {copies}"


def test_chart_ships_the_dashboard_verbatim() -> None:
    [configmap] = [o for o in manifests(render()) if o["kind"] == "ConfigMap"]
    assert configmap["data"]["xsp-sidecar.json"] == DASHBOARD.read_text().rstrip("\n")


def test_the_latency_panel_shows_exemplars_once() -> None:
    """Sampled calls leave a trace_id exemplar on xsp_request_duration_seconds; one target of
    the latency panel asks Grafana for them (each query would draw the same dots again)."""
    panels = _panels(dashboard())
    [panel] = [p for p in panels if p["title"] == "Latency percentiles (relay)"]
    with_exemplars = [t for t in panel["targets"] if t.get("exemplar")]
    assert [t["refId"] for t in with_exemplars] == ["C"]
    assert "xsp_request_duration_seconds_bucket" in with_exemplars[0]["expr"]
    assert "histogram_quantile(0.99," in with_exemplars[0]["expr"]
    assert "exemplarTraceIdDestinations" in panel["description"]
    others = [p for p in panels if p is not panel]
    assert not any(t.get("exemplar") for p in others for t in p.get("targets", []))


def test_every_request_family_panel_follows_the_protocol_variable() -> None:
    """The per-call families carry `protocol` (grpc | http): each panel that reads them either
    splits by it, picks one, or follows the dashboard's protocol variable."""
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["protocol"]["query"]["query"] == "label_values(xsp_requests_total, protocol)"
    families = ("xsp_requests_total{", "xsp_request_duration_seconds_", "xsp_request_bytes_total{",
                "xsp_response_bytes_total{")  # fmt: skip
    for expr in dashboard_exprs(dash):
        for series, matchers in SELECTOR.findall(expr):
            if not (series + "{").startswith(families):
                continue
            if 'method="ModelStreamInfer"' in matchers:
                continue  # gRPC only: REST has no streams
            assert "protocol" in matchers or "by (protocol)" in expr or "protocol=" in expr, expr
