"""The demos' REST traffic, beside their gRPC traffic: what was sent through the sidecar's HTTP
plane, by which client, and the "adding it up" lines that set it against `/metrics`.

Both demos (Triton, TF-Serving) use it: each sends its REST calls with its own clients, records
them in a `RestTraffic`, and passes it to `triton.account` (through `record_and_account`),
which prints `rest_lines` after the gRPC requests line. A JSON call is sent with `curl` where
it is on PATH (`post_json`), else with Python's urllib, and the line says which.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.trace.schema import PROTOCOL, Level, json_path
from tests.harness.metrics_text import sample_sum

REQUESTS = "xsp_requests_total"
GRPC, HTTP = "grpc", "http"  # the `protocol` label of the data plane's families


@dataclass
class RestTraffic:
    """REST calls a demo sent through the sidecar's HTTP plane: calls per client (in the order
    they are shown, e.g. `tritonclient.http (binary tensors)`, `curl (JSON)`) and how many of
    them the client saw fail."""

    sent: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    notes: list[str] = field(default_factory=list)  # shown under the REST line, e.g. resends

    def add(self, client: str, ok: bool = True) -> None:
        self.sent[client] = self.sent.get(client, 0) + 1
        self.errors += not ok

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def counted(metrics_text: str, protocol: str, **labels: str) -> int:
    """Calls the sidecar counted over `protocol` (`grpc` or `http`) with `labels`."""
    return round(sample_sum(metrics_text, REQUESTS, protocol=protocol, **labels))


def rest_lines(rest: RestTraffic, metrics_text: str, method: str) -> list[str]:
    """The "adding it up" lines of the REST calls: sent, per client, against what the sidecar
    counted with protocol="http" under `method` (the gRPC name of the same call: ModelInfer,
    Predict), then calls of other methods over HTTP (not the demo's) and client errors."""
    by_client = " + ".join(f"{n} {client}" for client, n in rest.sent.items()) or "0"
    got = counted(metrics_text, HTTP, method=method)
    differ = "" if got == rest.total else " (they differ!)"
    lines = [
        f"REST requests: {by_client} = {rest.total} sent; the sidecar counted {got} "
        f'(xsp_requests_total{{protocol="http"}}){differ}'
    ]
    lines.extend(rest.notes)
    others = counted(metrics_text, HTTP) - got
    if others:
        lines.append(f"  and {others} REST call(s) of other methods the demo did not send")
    if rest.errors:
        lines.append(f"REST traffic errors (the client saw them): {rest.errors}")
    return lines


BY_PROTOCOL = f"""
SELECT json_extract(attributes, '{json_path(PROTOCOL)}'), count(DISTINCT trace_id) FROM spans
WHERE level = '{Level.REQUEST.value}' GROUP BY 1
"""


def traces_by_protocol(db: Path) -> dict[str, int]:
    """The stored traces by the protocol their request span says (`grpc`, `http`)."""
    if not db.exists():
        return {}
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return {str(p): int(n) for p, n in conn.execute(BY_PROTOCOL).fetchall() if p}


def protocol_line(db: Path) -> str:
    """The "adding it up" line under the traces stored: how many came over each protocol."""
    found = traces_by_protocol(db)
    return f"  of them {found.get(GRPC, 0)} gRPC and {found.get(HTTP, 0)} REST calls"


def json_client() -> str:
    """The name `post_json` sends with: `curl` where it is on PATH, else `urllib`."""
    return "curl" if shutil.which("curl") else "urllib"


def post_json(url: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, Any]:
    """POST `body` as JSON to `url` with `curl` (or urllib, see `json_client`); the response's
    status and its JSON body (None when it is not JSON)."""
    data = json.dumps(body).encode()
    if json_client() == "curl":
        done = subprocess.run(
            ["curl", "-sS", "-X", "POST", "-H", "Content-Type: application/json",
             "--data-binary", "@-", "-w", "\n%{http_code}", "--max-time", str(timeout), url],
            input=data, capture_output=True, check=True, timeout=timeout + 5,
        )  # fmt: skip
        text, _, status = done.stdout.decode().rpartition("\n")
        return int(status), _json_or_none(text)
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), _json_or_none(response.read().decode())
    except urllib.error.HTTPError as exc:
        return int(exc.code), _json_or_none(exc.read().decode())


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
