"""The real demo (`python -m tests.harness.demo`, small): its console adds up against the
/metrics scrape it writes (demo-out/metrics.txt), gRPC and REST calls each against its own
count, names why profiles were skipped or failed, and its progress bars count each profile's
own work."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.trace.store import count_traces
from tests.harness import REPO_ROOT
from tests.harness.demo.triton import FORCEABLE
from tests.harness.metrics_text import sample_sum, sums_by

pytestmark = [pytest.mark.triton, pytest.mark.slow]

REQUESTS, FORCED, REST = 30, 3, 10  # REST: every fifth in KServe v2 JSON (curl), the rest binary


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    """(console, metrics.txt, output folder) of one small demo run whose forced requests go to
    simple_cnn, add_sub (a Python model, profiled by running its own model.py) and the
    ensemble ens_cnn (replayed as its steps, pre then simple_cnn)."""
    out = tmp_path_factory.mktemp("demo") / "demo-out"
    cmd = [
        sys.executable, "-m", "tests.harness.demo", "--requests", str(REQUESTS),
        "--forced", str(FORCED), "--forced-models", "simple_cnn,add_sub,ens_cnn", "--out", str(out),
        "--rest-requests", str(REST),
    ]  # fmt: skip
    run = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, timeout=240
    )
    assert run.returncode == 0, run.stdout[-4000:]
    return run.stdout, (out / "metrics.txt").read_text(), out


def _one(pattern: str, console: str) -> re.Match[str]:
    found = re.search(pattern, console, re.MULTILINE)
    assert found, f"no line matching {pattern!r} in:\n{console[-6000:]}"
    return found


def test_requests_add_up_to_what_metrics_counted(demo: tuple[str, str, Path]) -> None:
    console, metrics, _ = demo
    m = _one(
        r"gRPC requests: (\d+) traffic \+ (\d+) forced \+ (\d+) forced sent again = (\d+) sent; "
        r"the sidecar counted (\d+) \(xsp_requests_total\)$",
        console,
    )
    traffic, forced, again, sent, counted = map(int, m.groups())
    assert (traffic, forced) == (REQUESTS, FORCED)
    assert traffic + forced + again == sent == counted
    grpc = {"method": "ModelInfer", "protocol": "grpc"}
    assert counted == round(sample_sum(metrics, "xsp_requests_total", **grpc))
    # every forced call sent again is explained by the decision that turned it away
    decisions = sums_by(metrics, "xsp_sampling_decisions_total", "decision")
    retried = re.findall(r"(\d+) forced call\(s\) sent again: turned away by (\w+) \(.+\)", console)
    assert sum(int(n) for n, _ in retried) == again
    for n, decision in retried:
        assert decision.startswith("skipped_") and int(n) <= decisions[decision]


def test_rest_calls_add_up_beside_the_grpc_ones(demo: tuple[str, str, Path]) -> None:
    """The REST calls went through the sidecar's HTTP plane: tritonclient.http with binary
    tensors and KServe v2 JSON (curl), each counted under ModelInfer with protocol="http"."""
    console, metrics, _ = demo
    m = _one(
        r"^ +REST requests: (\d+) tritonclient\.http \(binary tensors\) \+ (\d+) (curl|urllib) "
        r"\(JSON\) \+ (\d+) tritonclient\.http \(binary tensors, x-xsp-profile: 1\) = (\d+) "
        r'sent; the sidecar counted (\d+) \(xsp_requests_total\{protocol="http"\}\)$',
        console,
    )
    binary, plain, forced, sent, counted = (int(m.group(i)) for i in (1, 2, 4, 5, 6))
    assert (binary, plain) == (REST - REST // 5, REST // 5)
    assert binary + plain + forced == sent == counted
    again = re.findall(r"(\d+) forced REST call\(s\) sent again: turned away by", console)
    assert forced == 1 + sum(int(n) for n in again)
    http = {"method": "ModelInfer", "protocol": "http"}
    assert counted == round(sample_sum(metrics, "xsp_requests_total", **http))
    # i % 5 == 4: add_sub in JSON; else i % 3 == 2: add_sub, binary; else simple_cnn, binary;
    # then the forced call(s) to simple_cnn
    per_model = {m: sample_sum(metrics, "xsp_requests_total", model=m, **http) for m in FORCEABLE}
    assert per_model == {"simple_cnn": 5 + forced, "add_sub": 5, "ens_cnn": 0}, per_model
    # the forced REST call was profiled, and its trace says it came over HTTP
    _one(r"forced REST profile 1/1 \(simple_cnn\): ok$", console)
    assert "REST traffic errors" not in console
    # the traces stored, by the protocol their request span says
    stored = int(_one(r"^ +traces stored: (\d+) ", console).group(1))
    m = _one(r"^ +of them (\d+) gRPC and (\d+) REST calls$", console)
    assert int(m.group(1)) + int(m.group(2)) == stored
    assert int(m.group(1)) >= FORCED and int(m.group(2)) >= 1
    # the REST line follows the gRPC lines, before the sampling decisions
    grpc_at, rest_at = console.index("gRPC requests: "), console.index("REST requests: ")
    assert grpc_at < rest_at < console.index("sampling decisions: ")


def test_decisions_and_skips_add_up_with_their_reasons(demo: tuple[str, str, Path]) -> None:
    console, metrics, _ = demo
    decisions = {
        d: round(n) for d, n in sums_by(metrics, "xsp_sampling_decisions_total", "decision").items()
    }
    m = _one(r"sampling decisions: (\d+) = (\d+) sampled \+ (\d+) skipped$", console)
    total, sampled, skipped = map(int, m.groups())
    assert total == sum(decisions.values()) == round(sample_sum(metrics, "xsp_requests_total"))
    assert sampled == decisions["sampled"] and sampled + skipped == total
    shown = {d: int(n) for n, d in re.findall(r"^ +skipped (\d+): .+ \((\w+)\)$", console, re.M)}
    assert shown == {d: n for d, n in decisions.items() if d != "sampled"}
    # 30 requests at 2 %: some are not drawn, and the console says so in words
    assert re.search(r"skipped \d+: not drawn at the 2% sample rate \(skipped_rate\)", console)


def test_profiles_add_up_and_failures_show_their_error(demo: tuple[str, str, Path]) -> None:
    console, metrics, out = demo
    outcomes = {o: round(n) for o, n in sums_by(metrics, "xsp_profiles_total", "outcome").items()}
    dropped = round(sample_sum(metrics, "xsp_samples_dropped_total"))
    m = _one(r"^ +sampled (\d+) = (\d+) profiled \+ (\d+) dropped$", console)
    sampled, profiled, shown_dropped = map(int, m.groups())
    assert sampled == profiled + shown_dropped
    assert (profiled, shown_dropped) == (sum(outcomes.values()), dropped)
    m = _one(r"^ +profiles: (\d+) = (.+)$", console)
    terms = dict(reversed(t.split(" ", 1)) for t in m.group(2).split(" + "))
    assert {o: int(n) for o, n in terms.items()} == outcomes
    assert outcomes.get("error", 0) == 0  # add_sub replays through its own model.py
    assert outcomes.get("live_only", 0) == 0
    _one(rf"forced profile 2/{FORCED} \(add_sub\): ok$", console)
    _one(rf"forced profile {FORCED}/{FORCED} \(ens_cnn\): ok$", console)
    assert not re.search(r"^ +failed \d+ \(add_sub\)", console, re.MULTILINE), console
    _one(rf"forced profile 1/{FORCED} \(simple_cnn\): ok$", console)
    m = _one(r"^ +traces stored: (\d+) \((\d+) ok, (\d+) failed\)$", console)
    stored, ok, failed = map(int, m.groups())
    db = out / "traces.db"
    assert (stored, ok, failed) == (
        count_traces(db),
        count_traces(db, status="ok"),
        count_traces(db, status="error"),
    )
    assert (ok, failed) == (outcomes.get("ok", 0), outcomes.get("error", 0))


def test_progress_bars_count_each_profile_not_the_store(demo: tuple[str, str, Path]) -> None:
    console, metrics, _ = demo
    bars = re.findall(
        r"^(forced profile \d+/\d+ \(\w+\)|profiles of sampled traffic): (\d+)/(\d+) profile",
        console.replace("\r", "\n"),
        re.MULTILINE,
    )
    forced = {desc for desc, _, _ in bars if desc.startswith("forced")}
    assert forced == {
        f"forced profile 1/{FORCED} (simple_cnn)",
        f"forced profile 2/{FORCED} (add_sub)",
        f"forced profile 3/{FORCED} (ens_cnn)",
    }
    sampled = round(sample_sum(metrics, "xsp_sampling_decisions_total", decision="sampled"))
    sampled_traffic = sampled - FORCED - 1  # and the forced REST call's
    for desc, n, total in bars:
        want = 1 if desc.startswith("forced") else sampled_traffic
        assert int(total) == want and int(n) <= want, (desc, n, total)
    assert not re.search(r"trace/s|profile/s", console)  # counts, not a rate over the store
