"""Shared helpers for the deployment checks: render the chart, read the contracts."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "xsp-sidecar"
DASHBOARD = CHART / "dashboards" / "xsp-sidecar.json"
CONTRACTS = REPO / "docs" / "contracts.md"
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion: gRPC probes are GA in 1.27)
# and a recent one; kubernetes-validate ships schemas for both.
KUBE_VERSIONS = ("1.27.0", "1.33.0")


def load_values_file(name: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / name).read_text())
    return values


def render(values: dict[str, Any] | None = None, *, namespace: str = "serving") -> dict[str, str]:
    """Render the chart offline with the real Helm engine: template path -> text."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name="demo", namespace=namespace, is_install=True)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects in a render (NOTES.txt and empty documents left out)."""
    objects: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name!r} in the Deployment")


def flag_values(args: list[str]) -> dict[str, str]:
    """`--name=value` / `--name value` / bare `--name` arguments as a dict (bare -> "")."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            if "=" in arg:
                key, value = arg.split("=", 1)
                out[key] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[arg] = args[i + 1]
                i += 1
            else:
                out[arg] = ""
        i += 1
    return out


@dataclass(frozen=True)
class ContractMetric:
    name: str
    type: str  # counter | gauge | histogram
    labels: frozenset[str]


def contract_metrics() -> dict[str, ContractMetric]:
    """The Prometheus metrics listed in the tables of docs/contracts.md."""
    section = CONTRACTS.read_text().split("## Prometheus metrics", 1)[1].split("\n## ", 1)[0]
    metrics: dict[str, ContractMetric] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`xsp_"):
            continue
        mtype = cells[1].split()[0]
        labels = frozenset(re.findall(r"`([a-z_]+)`", cells[2]))
        for name in re.findall(r"`(xsp_[a-z0-9_]+)`", cells[0]):
            metrics[name] = ContractMetric(name, mtype, labels)
    return metrics


def contract_flags() -> set[str]:
    """Every `--flag` named in the serve section of docs/contracts.md."""
    section = CONTRACTS.read_text().split("## Ports and defaults", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", section))


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and query variables."""
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if "expr" in t)
            walk(panel.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else str(query))
    return exprs
