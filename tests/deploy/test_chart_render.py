"""Render the Helm chart with the real Helm engine and validate it against Kubernetes schemas."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.helpers import (
    CHART,
    KUBE_VERSIONS,
    by_kind,
    container,
    flag_values,
    load_values_file,
    manifests,
    one,
    render,
)

TFSERVING = load_values_file("values-tfserving.yaml")
SCENARIOS: dict[str, dict[str, Any] | None] = {
    "triton": None,
    "tfserving": TFSERVING,
    "triton-full": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "sidecar": {
            "admin": {"enabled": True},
            "traceStore": {"persistence": {"enabled": True, "storageClass": "fast"}},
            "sampling": {"rate": 0.01, "budgetPerMinute": 12, "queueSize": 4},
            "profiling": {"levels": "M,L,K", "iterations": 20, "warmup": 3, "device": "cuda:0"},
            "gpu": {"enabled": True},
        },
        "modelRepository": {"volume": {"persistentVolumeClaim": {"claimName": "models"}}},
        "backend": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
        "grafana": {
            "tracingDatasourceUid": "tempo",
            "datasource": {"enabled": True, "url": "http://prometheus-operated:9090"},
        },
    },
}
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, manifests(render(SCENARIOS[request.param]))


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_manifest_is_valid_kubernetes(
    scenario: tuple[str, list[dict[str, Any]]], kube_version: str
) -> None:
    _, objects = scenario
    validated = 0
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            continue  # a CRD: kubernetes-validate ships no schema; checked in test_servicemonitor
        kubernetes_validate.validate(obj, kube_version, strict=True)
        validated += 1
    assert validated >= 4  # Deployment, Service, ServiceAccount, dashboard ConfigMap


def test_lint_is_clean_for_both_backends() -> None:
    for values in (None, TFSERVING):
        report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], report


def test_service_sends_clients_to_the_relay(scenario: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = scenario
    service = one(objects, "Service")
    deployment = one(objects, "Deployment")
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    sidecar_ports = {
        p["name"]: p["containerPort"] for p in container(deployment, "sidecar")["ports"]
    }
    assert ports["grpc"]["targetPort"] == "relay" and sidecar_ports["relay"] == 8011
    assert ports["metrics"]["targetPort"] == "metrics" and sidecar_ports["metrics"] == 8012
    assert ports["grpc"]["port"] == (8500 if name == "tfserving" else 8001)
    # REST too: the backend's usual HTTP port, to the sidecar's HTTP relay
    assert ports["http"]["targetPort"] == "http-relay" and sidecar_ports["http-relay"] == 8010
    assert ports["http"]["port"] == (8501 if name == "tfserving" else 8000)
    assert ports["http"]["appProtocol"] == "http"
    backend_names = {p["name"] for p in container(deployment, "backend")["ports"]}
    assert not {p["targetPort"] for p in ports.values()} & backend_names


def test_sidecar_flags_follow_the_contracts(scenario: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = scenario
    sidecar = container(one(objects, "Deployment"), "sidecar")
    args = sidecar["args"]
    assert sidecar["command"] == ["xsp-sidecar"] and "serve" in args
    flags = flag_values(args[args.index("serve") + 1 :])
    expected = {
        "--backend": "localhost:8500" if name == "tfserving" else "localhost:8001",
        "--listen": "0.0.0.0:8011",
        "--metrics-port": "8012",
        "--grpc-port": "8013",
        "--otlp-port": "4318",
        "--model-repository": "/models",
        "--db": "/data/traces.db",
        "--http-listen": "0.0.0.0:8010",
        "--http-backend": "localhost:8501" if name == "tfserving" else "localhost:8000",
    }
    assert {k: flags.get(k) for k in expected} == expected
    assert ("--backend-protocol" in flags) == (name == "tfserving")
    assert ("--admin" in flags) == (name == "triton-full")
    assert ("--admin-listen" in flags) == (name == "triton-full")
    rate = float(flags["--sample-rate"])
    assert rate == (0.01 if name == "triton-full" else 0.001)
    full = name == "triton-full"
    assert flags["--levels"] == ("M,L,K" if full else "M,L")
    assert flags["--iterations"] == ("20" if full else "10")
    assert flags["--queue-size"] == ("4" if full else "8")
    assert flags["--replay-device"] == ("cuda:0" if full else "auto")
    assert flags["--otlp-host"] == "127.0.0.1"  # the receiver stays pod-local
    if full:
        assert flags["--admin-listen"] == "127.0.0.1:8014"  # admin API: loopback only


@pytest.mark.parametrize(("values", "backend_port"), [(None, 8000), (TFSERVING, 8501)])
def test_the_http_relay_fronts_the_backends_rest_port(
    values: dict[str, Any] | None, backend_port: int
) -> None:
    """The sidecar relays the backend's own HTTP port (Triton's 8000, TF-Serving's 8501), the
    port the backend container declares and, for Triton, probes."""
    deployment = one(manifests(render(values)), "Deployment")
    backend = container(deployment, "backend")
    declared = {p["containerPort"]: p["name"] for p in backend["ports"]}
    args = container(deployment, "sidecar")["args"]
    flags = flag_values(args[args.index("serve") + 1 :])
    assert flags["--http-backend"] == f"localhost:{backend_port}"
    assert declared[backend_port] in {"backend-http", "backend-rest"}


@pytest.mark.parametrize(("values", "rest"), [(None, "backend-http"), (TFSERVING, "backend-rest")])
def test_turning_the_http_relay_off_sends_rest_straight_to_the_backend(
    values: dict[str, Any] | None, rest: str
) -> None:
    values = values or {}
    off = {**values, "sidecar": {**values.get("sidecar", {}), "http": {"enabled": False}}}
    objects = manifests(render(off))
    deployment = one(objects, "Deployment")
    sidecar = container(deployment, "sidecar")
    assert not any(a.startswith("--http-") for a in sidecar["args"])
    assert "http-relay" not in {p["name"] for p in sidecar["ports"]}
    ports = {p["name"]: p for p in one(objects, "Service")["spec"]["ports"]}
    assert ports["http"]["targetPort"] == rest
    assert rest in {p["name"] for p in container(deployment, "backend")["ports"]}
    assert ports["grpc"]["targetPort"] == "relay"  # gRPC still through the sidecar


def test_the_http_relay_listens_where_it_is_told() -> None:
    values = {"sidecar": {"http": {"listenPort": 9080}}, "service": {"httpPort": 80}}
    objects = manifests(render(values))
    sidecar = container(one(objects, "Deployment"), "sidecar")
    assert flag_values(sidecar["args"])["--http-listen"] == "0.0.0.0:9080"
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]}["http-relay"] == 9080
    ports = {p["name"]: p for p in one(objects, "Service")["spec"]["ports"]}
    assert ports["http"]["port"] == 80 and ports["http"]["targetPort"] == "http-relay"


def test_the_full_example_gives_backend_and_sidecar_a_gpu_each_from_the_device_plugin() -> None:
    deployment = one(manifests(render(SCENARIOS["triton-full"])), "Deployment")
    backend, sidecar = container(deployment, "backend"), container(deployment, "sidecar")
    assert backend["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sidecar["resources"]["limits"] == {"memory": "2Gi", "nvidia.com/gpu": 1}
    assert sidecar["image"] == "xsp-sidecar:0.1.0-gpu"
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # the device plugin picks the device


@pytest.mark.parametrize("otlp_port", [4318, 4400])
def test_triton_exports_spans_to_the_sidecar_for_traced_requests_only(otlp_port: int) -> None:
    deployment = one(manifests(render({"sidecar": {"otlpPort": otlp_port}})), "Deployment")
    backend = container(deployment, "backend")
    assert backend["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    args = backend["args"]
    trace_config = [args[i + 1] for i, a in enumerate(args) if a == "--trace-config"]
    assert "mode=opentelemetry" in trace_config
    assert f"opentelemetry,url=http://127.0.0.1:{otlp_port}/v1/traces" in trace_config
    sidecar = container(deployment, "sidecar")
    sidecar_flags = flag_values(sidecar["args"])
    assert sidecar_flags["--otlp-port"] == str(otlp_port)
    assert sidecar_flags["--otlp-host"] == "127.0.0.1"
    assert {p["name"]: p["containerPort"] for p in sidecar["ports"]}["otlp"] == otlp_port
    assert "rate=0" in trace_config  # only requests carrying a traceparent
    assert "level=TIMESTAMPS" in trace_config
    assert {"--model-repository=/models", "--grpc-port=8001"} <= set(args)


def test_tfserving_backend_serves_the_named_model() -> None:
    backend = container(one(manifests(render(TFSERVING)), "Deployment"), "backend")
    assert backend["image"].startswith("tensorflow/serving:")
    assert backend["command"] == ["tensorflow_model_server"]
    flags = flag_values(backend["args"])
    assert flags["--port"] == "8500"
    assert flags["--model_name"] == "resnet"
    assert flags["--model_base_path"] == "/models/resnet"
    assert not any(a.startswith("--trace-config") for a in backend["args"])


def test_the_tfserving_variant_replays_the_savedmodels_of_the_model_base_path() -> None:
    """values-tfserving.yaml: the sidecar (TensorFlow image) reads TF-Serving's model base path,
    mounted read-only into both containers, as its model repository, and captures the server's
    side through TF-Serving's ProfilerService into a folder both mount."""
    deployment = one(manifests(render(TFSERVING)), "Deployment")
    sidecar, server = container(deployment, "sidecar"), container(deployment, "backend")
    assert sidecar["image"] == "xsp-sidecar:0.1.0-tensorflow"
    args = sidecar["args"]
    flags = flag_values(args[args.index("serve") + 1 :])
    assert flags["--backend-protocol"] == "tfserving"
    assert flags["--backend"] == "localhost:8500"
    repository = flags["--model-repository"]
    assert flag_values(server["args"])["--model_base_path"] == f"{repository}/resnet"
    for c in (sidecar, server):
        [models] = [m for m in c["volumeMounts"] if m["name"] == "models"]
        assert models == {"name": "models", "mountPath": repository, "readOnly": True}, c["name"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {
        "claimName": "tfserving-models", "readOnly": True
    }  # fmt: skip
    assert flags["--tf-profiler-address"] == "backend"
    shared = [
        {m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tf-profiler"}
        for c in (sidecar, server)
    ]
    assert shared == [{flags["--tf-profiler-dir"]}] * 2 and "emptyDir" in volumes["tf-profiler"]


@pytest.mark.parametrize("backend", ["tfserving", "triton"])
def test_the_tf_profiler_shares_a_folder_with_tfserving_only(backend: str) -> None:
    values = {"backend": {"type": backend}, "sidecar": {"tfProfiler": {"enabled": True}}}
    if backend == "tfserving":
        values["backend"]["tfserving"] = {"modelName": "resnet"}
    deployment = one(manifests(render(values)), "Deployment")
    sidecar, server = container(deployment, "sidecar"), container(deployment, "backend")
    args = sidecar["args"]
    flags = flag_values(args[args.index("serve") + 1 :])
    mounts = [
        {m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tf-profiler"}
        for c in (sidecar, server)
    ]
    volumes = {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    if backend == "triton":  # TensorFlow's profiler is TF-Serving's
        assert not any(f.startswith("--tf-profiler") for f in flags)
        assert mounts == [set(), set()] and "tf-profiler" not in volumes
        return
    assert flags["--tf-profiler-address"] == "backend"
    assert flags["--tf-profiler-capture-ms"] == "200"
    assert mounts == [{flags["--tf-profiler-dir"]}] * 2 and "tf-profiler" in volumes


def test_probes_use_the_grpc_health_service(scenario: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = scenario
    sidecar = container(one(objects, "Deployment"), "sidecar")
    assert sidecar["readinessProbe"]["grpc"] == {"port": 8013}
    assert sidecar["livenessProbe"]["exec"]["command"] == [
        "xsp-healthcheck",
        "--live",
        "--port",
        "8013",
    ]


def test_containers_are_locked_down(scenario: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = scenario
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["runAsNonRoot"] is True, c["name"]
    assert (
        container(one(objects, "Deployment"), "sidecar")["securityContext"][
            "readOnlyRootFilesystem"
        ]
        is True
    )


def test_volumes_are_declared_and_trace_store_follows_persistence(
    scenario: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objects = scenario
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in pod["containers"]:
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes, (c["name"], mount["name"])
    sidecar_mounts = {m["mountPath"]: m for m in container(deployment, "sidecar")["volumeMounts"]}
    assert sidecar_mounts["/data"]["name"] == "traces"
    assert sidecar_mounts["/models"]["readOnly"] is True
    pvcs = by_kind(objects, "PersistentVolumeClaim")
    if name == "triton-full":
        claim = volumes["traces"]["persistentVolumeClaim"]["claimName"]
        assert [p["metadata"]["name"] for p in pvcs] == [claim]
        assert pvcs[0]["spec"]["storageClassName"] == "fast"
        assert deployment["spec"]["strategy"]["type"] == "Recreate"
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "models"}
    else:
        assert "emptyDir" in volumes["traces"] and pvcs == []


def test_servicemonitor_scrapes_the_metrics_port() -> None:
    """ServiceMonitor is a Prometheus Operator CRD: checked structurally, not by schema."""
    objects = manifests(render(SCENARIOS["triton-full"]))
    monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert by_kind(manifests(render()), "ServiceMonitor") == []


def test_dashboard_configmap_is_labelled_for_grafana() -> None:
    configmap = one(manifests(render({"dashboard": {"namespace": "monitoring"}})), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert by_kind(manifests(render({"dashboard": {"enabled": False}})), "ConfigMap") == []


def _grafana_datasource(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The provisioned datasource ConfigMap and the one datasource in its provisioning file."""
    [configmap] = [
        o for o in by_kind(manifests(render(values)), "ConfigMap")
        if "xsp-prometheus-datasource.yaml" in o["data"]
    ]  # fmt: skip
    provisioning = yaml.safe_load(configmap["data"]["xsp-prometheus-datasource.yaml"])
    assert provisioning["apiVersion"] == 1
    [datasource] = provisioning["datasources"]
    return configmap, datasource


def test_the_grafana_datasource_links_exemplars_to_the_tracing_datasource() -> None:
    values = {
        "grafana": {
            "tracingDatasourceUid": "tempo",
            "datasource": {
                "enabled": True,
                "url": "http://prometheus-operated.monitoring.svc:9090",
                "namespace": "monitoring",
            },
        }
    }
    configmap, datasource = _grafana_datasource(values)
    assert configmap["metadata"]["labels"]["grafana_datasource"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert datasource["type"] == "prometheus" and datasource["uid"] == "xsp-prometheus"
    assert datasource["url"] == "http://prometheus-operated.monitoring.svc:9090"
    [destination] = datasource["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == "trace_id"  # the exemplar label the relay writes
    assert destination["datasourceUid"] == "tempo" and "url" not in destination


def test_a_trace_url_outside_grafana_survives_provisioning_variable_expansion() -> None:
    url = "https://jaeger.example.com/trace/${__value.raw}"
    values = {"grafana": {"traceUrl": url, "datasource": {"enabled": True, "url": "http://p:9090"}}}
    _, datasource = _grafana_datasource(values)
    [destination] = datasource["jsonData"]["exemplarTraceIdDestinations"]
    # Grafana expands $VAR in provisioning files; $$ is its escape for a literal $
    assert destination["url"] == "https://jaeger.example.com/trace/$${__value.raw}"
    assert "datasourceUid" not in destination


def test_no_datasource_is_provisioned_by_default() -> None:
    configmaps = by_kind(manifests(render()), "ConfigMap")
    assert [c for c in configmaps if "grafana_datasource" in c["metadata"]["labels"]] == []
