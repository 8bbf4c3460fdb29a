"""values.schema.json and the chart's own checks reject values that cannot work."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.deploy.helpers import (
    CHART,
    container,
    flag_values,
    load_values_file,
    manifests,
    one,
    render,
)

# docs/contracts.md defaults; the chart's defaults must be the same.
CONTRACT_DEFAULTS = {
    "--otlp-port": "4318",
    "--otlp-host": "127.0.0.1",
    "--sample-rate": "0.001",
    "--sample-budget": "6",
    "--sample-force-header": "x-xsp-profile",
    "--duty-cycle": "0.05",
    "--queue-size": "8",
    "--levels": "M,L",
    "--iterations": "10",
    "--warmup": "2",
    "--profile-timeout": "120",
    "--replay-device": "auto",
    "--replay-python-models": "on",
    "--retention-max-traces": "1000",
    "--retention-max-mb": "512",
    "--retention-max-age-hours": "168",
}


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
        ({"sidecar": {"profiling": {"device": "gpu"}}}, "/sidecar/profiling/device"),
        ({"sidecar": {"gpu": {"mode": "mps"}}}, "/sidecar/gpu/mode"),
        ({"sidecar": {"gpu": {"count": 0}}}, "/sidecar/gpu/count"),
        (
            {"backend": {"triton": {"tracing": {"level": "TENSORS"}}}},
            "/backend/triton/tracing/level",
        ),
        ({"sidecar": {"logLevel": "chatty"}}, "/sidecar/logLevel"),
        ({"sidecar": {"profiling": {"levels": "M,X"}}}, "/sidecar/profiling/levels"),
        ({"sidecar": {"profiling": {"levels": ""}}}, "/sidecar/profiling/levels"),
        ({"sidecar": {"profiling": {"iterations": 0}}}, "/sidecar/profiling/iterations"),
        ({"sidecar": {"profiling": {"warmup": -1}}}, "/sidecar/profiling/warmup"),
        ({"sidecar": {"profiling": {"warmup": 1.5}}}, "/sidecar/profiling/warmup"),
        ({"sidecar": {"profiling": {"timeoutSeconds": 0}}}, "/sidecar/profiling/timeoutSeconds"),
        ({"sidecar": {"sampling": {"dutyCycle": 0}}}, "/sidecar/sampling/dutyCycle"),
        ({"sidecar": {"sampling": {"dutyCycle": 1.5}}}, "/sidecar/sampling/dutyCycle"),
        ({"sidecar": {"sampling": {"queueSize": 0}}}, "/sidecar/sampling/queueSize"),
        ({"sidecar": {"sampling": {"forceHeader": "x profile"}}}, "/sidecar/sampling/forceHeader"),
        (
            {"sidecar": {"traceStore": {"retention": {"maxTraces": -1}}}},
            "/sidecar/traceStore/retention/maxTraces",
        ),
        (
            {"sidecar": {"traceStore": {"retention": {"maxTraces": 10.5}}}},
            "/sidecar/traceStore/retention/maxTraces",
        ),
        (
            {"sidecar": {"traceStore": {"retention": {"maxMB": -1}}}},
            "/sidecar/traceStore/retention/maxMB",
        ),
        (
            {"sidecar": {"traceStore": {"retention": {"maxAgeHours": "1w"}}}},
            "/sidecar/traceStore/retention/maxAgeHours",
        ),
        (
            {"sidecar": {"traceStore": {"retention": {"maxBytes": 10}}}},
            "maxBytes",
        ),
        (
            {"sidecar": {"traceStore": {"storeRawInputs": "yes"}}},
            "/sidecar/traceStore/storeRawInputs",
        ),
        ({"sidecar": {"admin": {"port": 0}}}, "/sidecar/admin/port"),
        ({"sidecar": {"http": {"listenPort": 0}}}, "/sidecar/http/listenPort"),
        ({"sidecar": {"http": {"enabled": "yes"}}}, "/sidecar/http/enabled"),
        ({"sidecar": {"http": {"backend": "localhost:8000"}}}, "backend"),
        ({"service": {"httpPort": 70000}}, "/service/httpPort"),
        ({"sidecar": {"admin": {"host": "127.0.0.1:8014"}}}, "/sidecar/admin/host"),
        ({"sidecar": {"admin": {"host": ""}}}, "/sidecar/admin/host"),
        ({"sidecar": {"otlpHost": "http://localhost"}}, "/sidecar/otlpHost"),
        ({"sidecar": {"otlpPort": -1}}, "/sidecar/otlpPort"),
        ({"sidecar": {"otlpExport": {"endpoint": "collector:4317"}}}, "/sidecar/otlpExport"),
        ({"sidecar": {"otlpExport": {"protocol": "udp"}}}, "/sidecar/otlpExport/protocol"),
        ({"sidecar": {"traceStore": {"path": "traces.db"}}}, "/sidecar/traceStore/path"),
        ({"sidecar": {"sampleRate": 0.1}}, "sampleRate"),
        ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
        ({"grafana": {"traceUrl": "https://jaeger/trace/"}}, "/grafana/traceUrl"),
        ({"grafana": {"tracingDatasourceUid": "tempo prod"}}, "/grafana/tracingDatasourceUid"),
        ({"grafana": {"datasource": {"url": "prometheus:9090"}}}, "/grafana/datasource/url"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    assert where in _schema_error(values)


def test_install_with_bad_values_fails_before_rendering() -> None:
    with pytest.raises(helm.HelmValuesError, match="rate"):
        render({"sidecar": {"sampling": {"rate": 2.0}}})


@pytest.mark.parametrize(
    ("values", "missing"),
    [
        ({"sidecar": {"profiling": {"levels": None}}}, "levels"),
        ({"sidecar": {"traceStore": {"retention": {"maxMB": None}}}}, "maxMB"),
        ({"sidecar": {"admin": {"host": None}}}, "host"),
        ({"sidecar": {"http": {"listenPort": None}}}, "listenPort"),
    ],
)
def test_null_cannot_drop_a_setting_the_command_line_needs(
    values: dict[str, Any], missing: str
) -> None:
    """A null in user values deletes the key; the schema then refuses instead of rendering
    a flag without a value."""
    with pytest.raises(helm.HelmValuesError, match=f"missing property '{missing}'"):
        render(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sidecar": {"otlpPort": 0}}, "backend.triton.tracing.enabled=false"),
        ({"sidecar": {"admin": {"enabled": True, "port": 8013}}}, "same port"),
        ({"sidecar": {"otlpPort": 8001}}, "same port"),
        (
            {"replicaCount": 2, "sidecar": {"traceStore": {"persistence": {"enabled": True}}}},
            "replicaCount 1",
        ),
        ({"backend": {"type": "tfserving"}}, "needs backend.tfserving.modelName"),
        ({"sidecar": {"profiling": {"device": "cuda:1"}}}, "set sidecar.gpu.enabled=true"),
        ({"sidecar": {"metricsPort": 8002}}, "same port"),
        ({"sidecar": {"http": {"listenPort": 8000}}}, "same port"),  # Triton's own HTTP
        ({"sidecar": {"http": {"listenPort": 8011}}}, "same port"),  # the gRPC relay's
        (
            {"grafana": {"tracingDatasourceUid": "tempo", "datasource": {"enabled": True}}},
            "needs grafana.datasource.url",
        ),
        (
            {"grafana": {"datasource": {"enabled": True, "url": "http://p:9090"}}},
            "set grafana.tracingDatasourceUid",
        ),
        (
            {
                "grafana": {
                    "tracingDatasourceUid": "tempo",
                    "traceUrl": "https://j/trace/${__value.raw}",
                    "datasource": {"enabled": True, "url": "http://p:9090"},
                }
            },
            "only one of grafana.tracingDatasourceUid",
        ),
    ],
)
def test_conflicting_settings_fail_with_a_clear_message(
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
            "idleTimeoutSeconds": 0,
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
    assert flags["--idle-timeout"] == "0"
    assert flags["--tls-cert"] == "/tls/crt"
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts["traces"] == "/var/lib/xsp"


def _sidecar_flags(values: dict[str, Any] | None) -> dict[str, str]:
    args = container(one(manifests(render(values)), "Deployment"), "sidecar")["args"]
    return flag_values(args[args.index("serve") + 1 :])


def test_sampling_profiling_and_retention_defaults_are_the_contract_defaults() -> None:
    flags = _sidecar_flags(None)
    assert {k: flags.get(k) for k in CONTRACT_DEFAULTS} == CONTRACT_DEFAULTS
    assert "--store-raw-inputs" not in flags
    assert "--admin" not in flags and "--admin-listen" not in flags


def test_every_sampling_and_profiling_value_reaches_its_flag() -> None:
    flags = _sidecar_flags(
        {
            "sidecar": {
                "otlpPort": 4400,
                "otlpHost": "0.0.0.0",
                "sampling": {"forceHeader": "X-Debug-Profile", "dutyCycle": 0.5, "queueSize": 3},
                "profiling": {"levels": "M,L,K", "iterations": 1000000, "warmup": 0,
                              "timeoutSeconds": 30.5},
                "traceStore": {
                    "retention": {"maxTraces": 0, "maxMB": 2048, "maxAgeHours": 0.5},
                    "storeRawInputs": True,
                },
                "admin": {"enabled": True, "port": 9014},
            }
        }
    )  # fmt: skip
    assert flags["--otlp-port"] == "4400" and flags["--otlp-host"] == "0.0.0.0"
    assert flags["--sample-force-header"] == "X-Debug-Profile"
    assert flags["--duty-cycle"] == "0.5" and flags["--queue-size"] == "3"
    assert flags["--levels"] == "M,L,K"
    assert flags["--iterations"] == "1000000"  # not 1e+06: the sidecar parses it as int
    assert flags["--warmup"] == "0" and flags["--profile-timeout"] == "30.5"
    assert flags["--retention-max-traces"] == "0"
    assert flags["--retention-max-mb"] == "2048"
    assert flags["--retention-max-age-hours"] == "0.5"
    assert flags["--store-raw-inputs"] == ""
    assert flags["--admin"] == "" and flags["--admin-listen"] == "127.0.0.1:9014"


def _sidecar(values: dict[str, Any] | None) -> dict[str, Any]:
    return container(one(manifests(render(values)), "Deployment"), "sidecar")


def test_no_gpu_by_default() -> None:
    sidecar = _sidecar(None)
    assert sidecar["image"] == "xsp-sidecar:0.1.0"
    assert "nvidia.com/gpu" not in sidecar["resources"]["limits"]
    assert not {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"} & {
        e["name"] for e in sidecar["env"]
    }


def test_a_shared_gpu_resource_replays_on_the_device_plugins_share() -> None:
    """mode resource: the sidecar asks the device plugin for its own share of a GPU (a
    time-sliced or MPS resource), beside the limits it already had."""
    sidecar = _sidecar(
        {
            "sidecar": {
                "gpu": {"enabled": True, "resourceName": "nvidia.com/gpu.shared", "count": 2},
                "profiling": {"device": "cuda"},
                "image": {"tag": "custom"},
            }
        }
    )
    assert sidecar["resources"]["limits"] == {"memory": "2Gi", "nvidia.com/gpu.shared": 2}
    assert sidecar["resources"]["requests"] == {"cpu": "250m", "memory": "512Mi"}
    assert sidecar["image"] == "xsp-sidecar:custom"  # an explicit tag wins over -gpu
    args = sidecar["args"]
    assert flag_values(args[args.index("serve") + 1 :])["--replay-device"] == "cuda"


def test_visible_devices_shares_the_backends_gpu_without_a_request() -> None:
    sidecar = _sidecar(
        {
            "sidecar": {
                "gpu": {"enabled": True, "mode": "visibleDevices", "visibleDevices": "GPU-8f2e"}
            }
        }
    )
    assert "nvidia.com/gpu" not in sidecar["resources"]["limits"]
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-8f2e"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert sidecar["image"] == "xsp-sidecar:0.1.0-gpu"


def test_empty_force_header_disables_forced_samples() -> None:
    flags = _sidecar_flags({"sidecar": {"sampling": {"forceHeader": ""}}})
    assert flags["--sample-force-header"] == ""


def test_admin_port_is_declared_only_when_enabled_and_never_on_the_service() -> None:
    default = one(manifests(render()), "Deployment")
    assert "admin" not in {p["name"] for p in container(default, "sidecar")["ports"]}
    objects = manifests(render({"sidecar": {"admin": {"enabled": True, "host": "::1"}}}))
    sidecar = container(one(objects, "Deployment"), "sidecar")
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]}["admin"] == 8014
    assert flag_values(sidecar["args"])["--admin-listen"] == "[::1]:8014"
    service_ports = one(objects, "Service")["spec"]["ports"]
    assert all(p["targetPort"] != "admin" and p["port"] != 8014 for p in service_ports)


@pytest.mark.parametrize(
    ("otlp_host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:4318/v1/traces"),
        ("0.0.0.0", "http://127.0.0.1:4318/v1/traces"),
        ("::", "http://[::1]:4318/v1/traces"),
    ],
)
def test_triton_exports_to_the_address_the_receiver_binds(otlp_host: str, url: str) -> None:
    objects = manifests(render({"sidecar": {"otlpHost": otlp_host}}))
    args = container(one(objects, "Deployment"), "backend")["args"]
    assert f"opentelemetry,url={url}" in args


def test_otlp_receiver_can_be_turned_off_with_triton_tracing() -> None:
    values = {"sidecar": {"otlpPort": 0}, "backend": {"triton": {"tracing": {"enabled": False}}}}
    deployment = one(manifests(render(values)), "Deployment")
    sidecar = container(deployment, "sidecar")
    assert flag_values(sidecar["args"])["--otlp-port"] == "0"
    assert "otlp" not in {p["name"] for p in sidecar["ports"]}
    assert "--trace-config" not in container(deployment, "backend")["args"]


def test_the_otlp_export_is_off_by_default_and_reaches_its_flags() -> None:
    assert "--otlp-export" not in _sidecar_flags(None)
    endpoint = "grpc://otel-collector.observability:4317"
    flags = _sidecar_flags({"sidecar": {"otlpExport": {"endpoint": endpoint}}})
    assert flags["--otlp-export"] == endpoint and flags["--otlp-export-protocol"] == "auto"
    url = "http://tempo:4317"
    flags = _sidecar_flags({"sidecar": {"otlpExport": {"endpoint": url, "protocol": "grpc"}}})
    assert flags["--otlp-export"] == url and flags["--otlp-export-protocol"] == "grpc"
