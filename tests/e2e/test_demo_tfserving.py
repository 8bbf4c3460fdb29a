"""The demo on TF-Serving (`python -m tests.harness.demo --backend tfserving`, small): the
stand-in with the Keras models, the sidecar in front with the ProfilerService capture, gRPC
Predicts and REST Predicts (TF-Serving's REST API, through the sidecar's HTTP plane) each
adding up against its own count, forced Predicts turned into traces with Keras layers and
server op spans, and the report on them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.trace.store import count_traces
from tests.harness import REPO_ROOT
from tests.harness.demo.tfserving import FORCEABLE
from tests.harness.metrics_text import sample_sum, sums_by
from tests.harness.tfserving.models import CNN_LAYERS, TRANSFORMER_LAYERS

pytestmark = [pytest.mark.tfserving, pytest.mark.slow]

REQUESTS, FORCED, REST = 20, 2, 10  # REST: every fifth with curl, the rest with requests


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    """(console, metrics.txt, output folder) of one small TF-Serving demo run."""
    out = tmp_path_factory.mktemp("demo-tfserving") / "demo-out"
    cmd = [
        sys.executable, "-m", "tests.harness.demo", "--backend", "tfserving",
        "--requests", str(REQUESTS), "--forced", str(FORCED), "--out", str(out),
        "--rest-requests", str(REST),
    ]  # fmt: skip
    run = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, timeout=300
    )
    assert run.returncode == 0, run.stdout[-4000:]
    return run.stdout.replace("\r", "\n"), (out / "metrics.txt").read_text(), out


def _one(pattern: str, console: str) -> re.Match[str]:
    found = re.search(pattern, console, re.MULTILINE)
    assert found, f"no line matching {pattern!r} in:\n{console[-6000:]}"
    return found


def section(report: str, title: str, next_title: str) -> str:
    """The text report's section from `title` to the next section's title."""
    start = report.index(title)
    return report[start : report.index(next_title, start)]


def test_the_console_adds_up_against_metrics(demo: tuple[str, str, Path]) -> None:
    console, metrics, out = demo
    m = _one(
        r"gRPC requests: (\d+) traffic \+ (\d+) forced \+ (\d+) forced sent again = (\d+) sent; "
        r"the sidecar counted (\d+) \(xsp_requests_total\)$",
        console,
    )
    traffic, forced, again, sent, counted = map(int, m.groups())
    assert (traffic, forced) == (REQUESTS, FORCED)
    assert (
        traffic + forced + again
        == sent
        == counted
        == round(sample_sum(metrics, "xsp_requests_total", method="Predict", protocol="grpc"))
    )
    outcomes = {o: round(n) for o, n in sums_by(metrics, "xsp_profiles_total", "outcome").items()}
    assert outcomes.get("ok", 0) >= FORCED
    m = _one(r"^ +traces stored: (\d+) \((\d+) ok, (\d+) failed\)$", console)
    assert int(m.group(1)) == count_traces(out / "traces.db")
    captures = {
        o: round(n) for o, n in sums_by(metrics, "xsp_backend_captures_total", "outcome").items()
    }
    m = _one(
        r"server-side captures \(ProfilerService, xsp_backend_captures_total\): (\d+)", console
    )
    assert int(m.group(1)) == sum(captures.values())
    assert sum(captures.values()) == round(
        sample_sum(metrics, "xsp_sampling_decisions_total", decision="sampled")
    )


def test_rest_predicts_add_up_beside_the_grpc_ones(demo: tuple[str, str, Path]) -> None:
    """REST Predicts went through the sidecar's HTTP plane (row and columnar JSON with
    requests, every fifth with curl), each counted under Predict and its model with
    protocol="http"."""
    console, metrics, _ = demo
    m = _one(
        r"^ +REST requests: (\d+) requests \(instances\) \+ (\d+) requests \(inputs\) \+ "
        r"(\d+) (curl|urllib) \(JSON\) = (\d+) sent; the sidecar counted (\d+) "
        r'\(xsp_requests_total\{protocol="http"\}\)$',
        console,
    )
    rows, columns, plain, sent, counted = (int(m.group(i)) for i in (1, 2, 3, 5, 6))
    # i % 5 == 4: curl; else i % 3 == 2: keras_transformer (inputs); else keras_cnn (instances)
    assert (rows, columns, plain) == (5, 3, 2)
    assert rows + columns + plain == sent == counted == REST
    http = {"method": "Predict", "protocol": "http"}
    assert counted == round(sample_sum(metrics, "xsp_requests_total", **http))
    per_model = {m: sample_sum(metrics, "xsp_requests_total", model=m, **http) for m in FORCEABLE}
    assert per_model == {"keras_cnn": 7, "keras_transformer": 3}, per_model
    assert "REST traffic errors" not in console
    grpc_at, rest_at = console.index("gRPC requests: "), console.index("REST requests: ")
    assert grpc_at < rest_at < console.index("sampling decisions: ")
    _one(r"sent 10 REST Predicts \(5 requests \(instances\), 3 requests \(inputs\), 2 "
         r"(curl|urllib) \(JSON\)\): 10 ok, 0 errors$", console)  # fmt: skip


def test_the_forced_traces_show_server_op_spans_and_keras_layers(
    demo: tuple[str, str, Path],
) -> None:
    console, metrics, _ = demo
    _one(r"forced profile 1/2 \(keras_cnn\): ok$", console)
    _one(r"forced profile 2/2 \(keras_transformer\): ok$", console)
    for model, layers in (("keras_cnn", CNN_LAYERS), ("keras_transformer", TRANSFORMER_LAYERS)):
        m = _one(
            rf"^ +{model} \(batch 32\): proxy span > (\d+) server op spans > replay M > L: "
            r"(.+) \(\+\d+ ops outside layers\)$",
            console,
        )
        assert m.group(2).split(", ") == list(layers)
        captured = sums_by(metrics, "xsp_backend_captures_total", "outcome")
        assert int(m.group(1)) > 0 or captured.get("no_ops", 0) > 0  # no_ops: said on /metrics


def test_the_report_names_keras_layers_and_splits_latency_at_the_servers_ops(
    demo: tuple[str, str, Path],
) -> None:
    console, _, out = demo
    report = console[console.index("xsp-sidecar trace report") :]
    a2 = section(report, "\nA2: Layer table", "\nA3: ")
    for name in CNN_LAYERS:  # the transformer's rows come later than the text shows
        assert re.search(rf"^ +keras_cnn +32 +\d+ +{name} ", a2, re.MULTILINE), name
    a14 = section(report, "\nA14: Layer roofline", "\nA15: ")
    for name in TRANSFORMER_LAYERS:
        assert re.search(rf"^ +keras_transformer +32 +\d+ +{name} ", a14, re.MULTILINE), name
    live = section(report, "\nlive breakdown: ", "\noverhead: ")  # findings say "overhead:" too
    captured = re.findall(r"^ +(keras_\w+) \(batch 32\): proxy span > (\d+) server", console, re.M)
    assert captured
    for model, server_spans in captured:
        assert re.search(rf"^ +{model} +client_total ", live, re.MULTILINE), live
        if int(server_spans):  # its capture caught it (else no_ops, checked above)
            assert re.search(rf"^ +{model} +tf_ops ", live, re.MULTILINE), live
            assert re.search(rf"^ +{model} +outside_tf_ops ", live, re.MULTILINE), live
    assert (out / "report" / "report.html").is_file()
    assert (out / "sweep-report" / "report.html").is_file()
    _one(r"a standalone batch-size sweep of keras_cnn \(xsp-sidecar profile\):", console)
