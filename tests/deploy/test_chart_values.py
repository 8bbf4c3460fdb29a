"""values.schema.json and the chart's own checks reject values that cannot work."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.deploy.helpers import CHART, flag_values, load_values_file, manifests, one, render


def _schema_error(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(chart.merge_values(values))
    return str(caught.value)


def test_defaults_and_tfserving_example_pass_the_schema() -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.values)
        chart.validate_schema(chart.merge_values(load_values_file("values-tfserving.yaml")))


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"sidecar": {"sampling": {"rate": 2.0}}}, "/sidecar/sampling/rate"),
        ({"sidecar": {"sampling": {"rate": -0.1}}}, "/sidecar/sampling/rate"),
        ({"sidecar": {"sampling": {"budgetPerMinute": -1}}}, "/sidecar/sampling/budgetPerMinute"),
        ({"sidecar": {"metricsPort": 70000}}, "/sidecar/metricsPort"),
        ({"sidecar": {"grpcPort": "8013"}}, "/sidecar/grpcPort"),
        ({"backend": {"type": "torchserve"}}, "/backend/type"),
        (
            {"backend": {"triton": {"tracing": {"level": "TENSORS"}}}},
            "/backend/triton/tracing/level",
        ),
        ({"sidecar": {"logLevel": "chatty"}}, "/sidecar/logLevel"),
        ({"sidecar": {"profiling": {"levels": "M,X"}}}, "/sidecar/profiling/levels"),
        ({"sidecar": {"traceStore": {"path": "traces.db"}}}, "/sidecar/traceStore/path"),
        ({"sidecar": {"sampleRate": 0.1}}, "sampleRate"),
        ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    assert where in _schema_error(values)


def test_install_with_bad_values_fails_before_rendering() -> None:
    with pytest.raises(helm.HelmValuesError, match="rate"):
        render({"sidecar": {"sampling": {"rate": 2.0}}})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sidecar": {"profiling": {"levels": "M,L"}}}, "levels is not supported yet"),
        (
            {"sidecar": {"traceStore": {"retention": {"maxTraces": 1000}}}},
            "maxTraces is not supported yet",
        ),
        (
            {"replicaCount": 2, "sidecar": {"traceStore": {"persistence": {"enabled": True}}}},
            "replicaCount 1",
        ),
        ({"backend": {"type": "tfserving"}}, "needs backend.tfserving.modelName"),
        ({"sidecar": {"metricsPort": 8002}}, "same port"),
    ],
)
def test_unsupported_or_conflicting_settings_fail_with_a_clear_message(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_settings_reach_the_sidecar_command_line() -> None:
    values = {
        "sidecar": {
            "sampling": {"rate": 0.25, "budgetPerMinute": 3},
            "traceStore": {"path": "/var/lib/xsp/t.db"},
            "maxModels": 7,
            "gracePeriodSeconds": 4,
            "extraArgs": ["--tls-cert=/tls/crt"],
        }
    }
    deployment = one(manifests(render(values)), "Deployment")
    sidecar = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"
    )
    flags = flag_values(sidecar["args"])
    assert flags["--sample-rate"] == "0.25"
    assert flags["--sample-budget"] == "3"
    assert flags["--db"] == "/var/lib/xsp/t.db"
    assert flags["--max-models"] == "7"
    assert flags["--grace-period"] == "4"
    assert flags["--tls-cert"] == "/tls/crt"
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts["traces"] == "/var/lib/xsp"
