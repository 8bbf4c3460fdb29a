"""Every metric the dashboard and the chart query is one a real sidecar actually exports, and
every dashboard query runs on a real Prometheus that scrapes it.

`test_dashboard.py` checks the dashboard against docs/contracts.md; this checks it against the
running code: the real `xsp-sidecar serve` process, sampling on, its gRPC and HTTP relays in
front of the real local Triton server exporting OpenTelemetry spans to the sidecar (so the
backend phase histograms exist), after traffic that includes a forced sample, queue overflow,
REST calls (`tritonclient.http`) and one malformed HTTP request the relay refuses. /metrics is
scraped over HTTP and parsed as Prometheus text; then a real `prometheus` scrapes it and runs
each of the dashboard's queries, its variables given the values Grafana's "All" gives them.
"""

from __future__ import annotations

import queue
import re
import socket
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.deploy.helpers import dashboard, dashboard_exprs, render
from tests.e2e.helpers import cnn_infer, wait_until
from tests.harness.metrics_text import families
from tests.harness.process import free_port
from tests.harness.prometheus import PrometheusServer, prometheus_binary
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.server import TritonServer

pytestmark = [pytest.mark.triton, pytest.mark.slow]

METRIC = re.compile(r"\b(xsp_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b(xsp_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
# Sample-name suffixes of a family of each type (prometheus_client names a counter's family
# without `_total`, its samples with it).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
# Labels Prometheus adds when it scrapes (target labels), not exported by the sidecar.
TARGET_LABELS = {"instance", "job", "namespace", "pod"}
# Series that only get samples when something fails (a failed observation); their family
# must still be declared.
FAILURE_ONLY = {"xsp_observation_failures_total"}
# Series that only get samples from a decoupled model (two responses to one request); the
# sample models are not decoupled: tests/proxy/test_stream_triton.py checks them with one.
DECOUPLED_ONLY = {"xsp_response_gap_seconds_count"}


@dataclass
class Exposition:
    """A Prometheus text exposition: family types, and the label sets of each sample name."""

    types: dict[str, str] = field(default_factory=dict)
    samples: dict[str, list[dict[str, str]]] = field(default_factory=lambda: defaultdict(list))
    names: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    @classmethod
    def parse(cls, text: str) -> Exposition:
        out = cls()
        for family in families(text):
            out.types[family.name] = family.type
            for sample in family.samples:
                out.samples[sample.name].append(dict(sample.labels))
                out.names[family.name].add(sample.name)
        return out

    def family(self, series: str) -> str | None:
        """The exported family a referenced series belongs to, None when none is exported."""
        if self.types.get(series) not in (None, "counter"):
            return series
        for mtype, suffixes in SUFFIXES.items():
            for suffix in suffixes:
                base = series.removesuffix(suffix)
                if base != series and self.types.get(base) == mtype:
                    return base
        return None

    def series(self, family: str) -> str:
        """The series that has a sample for every label set of `family`."""
        return family + {"counter": "_total", "histogram": "_count"}.get(self.types[family], "")


def referenced_metrics() -> dict[str, set[str]]:
    """Metric names in the dashboard's PromQL and in every chart template -> where."""
    where: dict[str, set[str]] = defaultdict(set)
    for expr in dashboard_exprs(dashboard()):
        for name in METRIC.findall(expr):
            where[name].add("dashboard PromQL")
    for values in (
        None,
        {"serviceMonitor": {"enabled": True}, "sidecar": {"admin": {"enabled": True}}},
    ):
        for path, text in render(values).items():
            for name in METRIC.findall(text):
                where[name].add(path)
    return where


@pytest.fixture(scope="module")
def live_sidecar(
    traced_triton: TritonServer, otlp_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SidecarProcess]:
    """The sidecar after the traffic above: every family the dashboard reads has series."""
    tmp = tmp_path_factory.mktemp("dashboard-sidecar")
    args = [
        "--model-repository", str(traced_triton.model_repository),
        "--db", str(tmp / "traces.db"), "--otlp-port", str(otlp_port),
        # every request sampled, a one-slot queue: the burst below overflows it
        "--sample-rate", "1", "--sample-budget", "1000", "--duty-cycle", "1",
        "--queue-size", "1", "--levels", "M,L", "--iterations", "3", "--warmup", "1",
        "--admin", "--admin-listen", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    proc = SidecarProcess(
        backend=traced_triton.grpc_address, log_path=tmp / "sidecar.log", args=args,
        http_backend=traced_triton.http_address,  # the HTTP plane, in front of Triton's REST
    )  # fmt: skip
    with proc:
        client = grpcclient.InferenceServerClient(proc.address)
        cnn_infer(client, headers={"x-xsp-profile": "1"})  # forced: profiled first
        for _ in range(20):
            cnn_infer(client)
        client.get_model_metadata("simple_cnn")
        stream_infer(client)  # one ModelStreamInfer stream: its inference and the stream
        rest_infer(proc.http_address)  # REST calls through the HTTP relay
        refused_http(proc.http_port)  # one malformed request: refused, counted
        for name, labels in (
            ("xsp_profiles_total", {"outcome": "ok"}),
            ("xsp_backend_phase_duration_seconds_count", {"phase": "compute_infer"}),
            ("xsp_profiled_latency_seconds", {"level": "layer"}),
            ("xsp_layer_type_time_share", {}),
            ("xsp_profiling_overhead_ratio", {}),
            ("xsp_samples_dropped_total", {"reason": "queue_full"}),
            ("xsp_requests_total", {"protocol": "http"}),
            ("xsp_http_refused_total", {"reason": "malformed"}),
        ):
            assert wait_until(lambda n=name, kv=labels: proc.metric(n, **kv) > 0, 120), (
                f"{name}{labels} never exported\n{proc.log()}"
            )
        yield proc


@pytest.fixture(scope="module")
def exposition(live_sidecar: SidecarProcess) -> Exposition:
    return Exposition.parse(live_sidecar.metrics())


def rest_infer(address: str) -> None:
    """KServe v2 REST calls through the HTTP relay: binary-tensor inferences and metadata."""
    client = httpclient.InferenceServerClient(address)
    try:
        for _ in range(5):
            x = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
            x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32), binary_data=True)
            client.infer("simple_cnn", [x])
        client.get_model_metadata("simple_cnn")
    finally:
        client.close()


def refused_http(port: int) -> None:
    """A request line no HTTP server accepts: the relay answers 400 and closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]


def stream_infer(client: grpcclient.InferenceServerClient) -> None:
    """One `simple_cnn` inference on a `ModelStreamInfer` stream, waited for."""
    results: queue.Queue[object] = queue.Queue()
    x = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer("simple_cnn", [x])
        reply = results.get(timeout=60)
        assert not isinstance(reply, Exception), reply
    finally:
        client.stop_stream()


def test_every_referenced_metric_is_exported(exposition: Exposition) -> None:
    referenced = referenced_metrics()
    assert referenced, "no xsp_ metric found in the dashboard or the chart: the scan is broken"
    missing = {
        name: sorted(where) for name, where in referenced.items() if exposition.family(name) is None
    }
    assert not missing, f"referenced but not exported by `xsp-sidecar serve`: {missing}"


def test_referenced_metrics_have_samples(exposition: Exposition) -> None:
    """Not only a `# TYPE` line: after the traffic above every family has series."""
    empty = []
    for name in referenced_metrics():
        family = exposition.family(name)
        assert family is not None
        series = exposition.series(family)
        if series not in FAILURE_ONLY | DECOUPLED_ONLY and not exposition.samples.get(series):
            empty.append(series)
    assert not empty, f"exported without any series after sampled traffic: {sorted(empty)}"


def test_dashboard_selectors_match_exported_labels_and_values(exposition: Exposition) -> None:
    """Each `label="value"` (or literal `a|b` regex) in the dashboard matches real series."""
    problems: list[str] = []
    for expr in dashboard_exprs(dashboard()):
        for series, matchers in SELECTOR.findall(expr):
            family = exposition.family(series)
            assert family is not None, series
            samples = exposition.samples.get(series, [])
            if not samples:
                continue  # a failure-only family: nothing to compare against
            for label, op, value in MATCHER.findall(matchers):
                if label in TARGET_LABELS:
                    continue
                seen = {s[label] for s in samples if label in s}
                if not seen:
                    problems.append(f"{series} has no label {label!r} (in {expr})")
                    continue
                if "$" in value or op in ("!=", "!~"):
                    continue
                wanted = value.split("|") if op == "=~" else [value]
                if all(re.fullmatch(r"[\w-]+", w) for w in wanted):
                    absent = [w for w in wanted if w not in seen]
                    if absent:
                        problems.append(f"{series}{{{label}}} never takes {absent}; seen {seen}")
    assert not problems, "\n".join(problems)


def test_histograms_and_counters_have_their_standard_series(exposition: Exposition) -> None:
    for family, mtype in exposition.types.items():
        if not family.startswith("xsp_"):
            continue
        if mtype == "counter":
            assert exposition.names[family] <= {family + "_total", family + "_created"}, family
        if mtype == "histogram" and exposition.samples.get(family + "_count"):
            for suffix in SUFFIXES["histogram"]:
                assert exposition.samples.get(family + suffix), family + suffix


# What Grafana puts in for the dashboard's variables ("All" of a query variable is its
# allValue, .*) and its interval macros, against a Prometheus that scrapes every second.
GRAFANA_VALUES = {
    "__rate_interval": "15s",
    "__range": "5m",
    "instance": ".*",
    "model": ".*",
    "protocol": ".*",
}
# Queries that may rightly come back empty after traffic without failures: no call failed, no
# observation failed, no model is decoupled.
EMPTY_WITHOUT_FAILURES = (
    'grpc_code!="OK"',
    "xsp_observation_failures_total",
    "xsp_response_gap_seconds",
)
LABEL_VALUES = re.compile(r"^label_values\((\w+), (\w+)\)$")


def grafana_expr(expr: str) -> str:
    """`expr` with the dashboard's variables replaced as Grafana replaces them."""
    return re.sub(r"\$(\w+)", lambda m: GRAFANA_VALUES[m.group(1)], expr)


@pytest.fixture(scope="module")
def prometheus(
    live_sidecar: SidecarProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping the live sidecar every second, after five scrapes."""
    if prometheus_binary() is None:
        pytest.skip("no prometheus binary (apt-get install prometheus; scripts/test.sh does)")
    tmp = tmp_path_factory.mktemp("prometheus")
    target = f"127.0.0.1:{live_sidecar.metrics_port}"
    server = PrometheusServer(targets=[target], data_dir=tmp, log_path=tmp / "prometheus.log")
    with server:
        assert wait_until(lambda: server.scrapes() >= 5, 60), server.log()
        up = server.query(f'up{{instance="{target}"}}')
        assert [s["value"][1] for s in up] == ["1"], (up, server.log())
        yield server


def test_every_dashboard_query_runs_on_prometheus_and_finds_series(
    prometheus: PrometheusServer,
) -> None:
    """Each panel query parses and evaluates on a real Prometheus (2.x, Debian's) and, but for
    the failure-only ones, returns series: the panel shows something."""
    empty, failed = [], []
    for expr in dashboard_exprs(dashboard()):
        if LABEL_VALUES.match(expr):
            continue  # a Grafana variable query: test_the_variables_list_what_grafana_offers
        try:
            result = prometheus.query(grafana_expr(expr))
        except RuntimeError as exc:
            failed.append(f"{expr}\n    {exc}")
            continue
        if not result and not any(word in expr for word in EMPTY_WITHOUT_FAILURES):
            empty.append(expr)
    assert not failed, "queries Prometheus refused:\n" + "\n".join(failed)
    assert not empty, "queries without any series after the traffic:\n" + "\n".join(empty)


def test_the_variables_list_what_grafana_offers(
    prometheus: PrometheusServer, live_sidecar: SidecarProcess
) -> None:
    """label_values(...) of each query variable, as Grafana asks Prometheus for it: both
    protocols, the model, this sidecar."""
    offered = {}
    for expr in dashboard_exprs(dashboard()):
        match = LABEL_VALUES.match(expr)
        if match:
            offered[match.group(2)] = set(prometheus.label_values(*match.groups()))
    assert {"grpc", "http"} <= offered["protocol"]
    assert "simple_cnn" in offered["model"]
    assert f"127.0.0.1:{live_sidecar.metrics_port}" in offered["instance"]


def test_rest_traffic_shows_on_the_protocol_panels(prometheus: PrometheusServer) -> None:
    """What the REST share and the refused-by-reason panels count is there: REST calls beside
    gRPC ones, one malformed request (the counters themselves: the traffic came before the
    first scrape, so their rates are 0)."""
    share = prometheus.query('sum(xsp_requests_total{protocol="http"}) / sum(xsp_requests_total)')
    assert share and 0 < float(share[0]["value"][1]) < 1, share
    refused = prometheus.query("sum by (reason) (xsp_http_refused_total)")
    by_reason = {s["metric"]["reason"]: float(s["value"][1]) for s in refused}
    assert by_reason.get("malformed", 0) >= 1, by_reason


def test_the_latency_panel_finds_the_sampled_calls_trace_ids(prometheus: PrometheusServer) -> None:
    """The one latency target with exemplars on gets the sampled calls' `trace_id` exemplars
    from Prometheus (exemplar storage on, scraped as OpenMetrics): the dots Grafana links to
    the traces."""
    [panel] = [p for p in dashboard()["panels"] if p["title"] == "Latency percentiles (relay)"]
    [target] = [t for t in panel["targets"] if t.get("exemplar")]
    found = prometheus.exemplars(grafana_expr(target["expr"]))
    trace_ids = {e["labels"].get("trace_id") for e in found}
    assert trace_ids - {None}, found
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in trace_ids if t), trace_ids
