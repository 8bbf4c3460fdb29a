"""scripts/http_attack.py against the HTTP relay in front of the REAL Triton server: each bad
input gets its answer and is counted, the process's memory stays flat, normal calls go on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.proxy.http import HttpLimits
from tests.harness.metrics_text import sample_value, scrape_registry
from tests.proxy.http_harness import HttpRelayThread

pytestmark = pytest.mark.triton
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "http_attack.py"
ROUNDS = 4


@pytest.fixture(scope="module")
def relay(triton: Any) -> Iterator[HttpRelayThread]:
    side = HttpRelayThread(triton.http_address, limits=HttpLimits(header_timeout_s=1.0))
    yield side
    side.close()


def attack(relay: HttpRelayThread, *args: str) -> dict[str, Any]:
    command = [
        sys.executable, str(SCRIPT), "--target", relay.address, "--pid", str(os.getpid()),
        "--slowloris-seconds", "4", "--timeout", "5", "--json", *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_every_attack_answered_counted_and_memory_flat(relay: HttpRelayThread) -> None:
    report = attack(relay, "--rounds", str(ROUNDS))
    failed = [o for o in report["outcomes"] if not o["ok"]]
    assert not failed, failed
    by_case = {o["case"]: o for o in report["outcomes"]}
    assert by_case["slowloris"]["status"] == 408 and by_case["slowloris"]["seconds"] < 3.5
    assert by_case["normal"]["status"] == 200
    text = scrape_registry(relay.registry)  # a real HTTP scrape of the relay's registry

    def refused(reason: str) -> float:
        return sample_value(text, "xsp_http_refused_total", reason=reason) or 0.0

    assert refused("malformed") == 2 * ROUNDS  # not HTTP, and a bad chunk size
    assert refused("smuggling") == 2 * ROUNDS  # CL with TE, two CLs
    assert refused("header_too_large") == ROUNDS
    assert refused("body_too_large") == ROUNDS
    assert refused("header_timeout") == ROUNDS
    assert refused("upgrade") == ROUNDS  # the upgrade with a body; the one without is relayed
    assert refused("backend_unavailable") == 0
    # the smuggled requests never reached Triton: only the relayed ones are calls
    assert sample_value(text, "xsp_requests_total", method="ServerReady", model="_unknown",
                        grpc_code="OK", protocol="http") == ROUNDS + 1  # fmt: skip
    before, after = report["rss_kib_before"], report["rss_kib_after"]
    assert before and after and after - before < 16 << 10, (before, after)
    assert relay.in_loop(relay.relay.in_flight) == 0
    assert relay.in_loop(lambda: len(relay.relay.connections)) == 0


def test_normal_calls_unhurt_after_the_attacks(relay: HttpRelayThread) -> None:
    import tritonclient.http as httpclient

    attack(relay, "--case", "smuggling_cl_te", "--case", "header_too_large",
           "--slowloris-seconds", "0")  # fmt: skip
    client = httpclient.InferenceServerClient(relay.address, concurrency=4)
    a = np.arange(64, dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [64], "FP32"),
              httpclient.InferInput("INPUT1", [64], "FP32")]  # fmt: skip
    for item in inputs:
        item.set_data_from_numpy(a, binary_data=True)
    pending = [client.async_infer("add_sub", inputs) for _ in range(16)]
    for request in pending:
        np.testing.assert_array_equal(request.get_result().as_numpy("OUTPUT0"), a + a)
    client.close()
