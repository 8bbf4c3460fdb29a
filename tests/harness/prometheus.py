"""A real Prometheus server (the `prometheus` binary) scraping local targets, and its query API.

Tests run the dashboard's PromQL on it, as Grafana would: `query` evaluates one expression at
the current time, `label_values` answers Grafana's `label_values(metric, label)`. Debian's
`prometheus` package provides the binary (`scripts/test.sh` installs it where it can).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tests.harness.process import ChildProcess, StartError, free_port, polled


class PrometheusStartError(StartError):
    """`prometheus` exited during start-up or was not ready in time (with its log)."""


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@dataclass
class PrometheusServer(ChildProcess):
    """`prometheus` scraping `targets` (HOST:PORT, path /metrics) every `interval`, its data in
    `data_dir`, with exemplar storage on (the dashboard's latency panel reads exemplars)."""

    NAME: ClassVar[str] = "prometheus"
    READY: ClassVar[str] = "ready (/-/ready)"
    START_ERROR: ClassVar[type[StartError]] = PrometheusStartError

    targets: Sequence[str]
    data_dir: Path
    log_path: Path
    interval: str = "1s"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def before_start(self) -> None:
        if prometheus_binary() is None:
            raise PrometheusStartError(
                "no prometheus binary on PATH (apt-get install prometheus)", self.log_path, "", ""
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "scrape_configs": [
                {"job_name": "xsp-sidecar", "static_configs": [{"targets": list(self.targets)}]}
            ],
        }
        (self.data_dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML

    def command(self) -> list[str]:
        binary = prometheus_binary()
        assert binary is not None
        return [
            binary,
            f"--config.file={self.data_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--enable-feature=exemplar-storage",
            "--log.level=warn",
        ]

    def readiness(self) -> contextlib.AbstractContextManager[Callable[[], bool]]:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    return bool(reply.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        return polled(ready)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/`path`; the `data` of a success, else `PrometheusQueryError`."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:  # 400/422: a bad query, with Prometheus's words
            body = json.load(exc)
        if body.get("status") != "success":
            raise PrometheusQueryError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (or a scalar as one element)."""
        data = self.api("query", query=expr)
        result = data["result"]
        return [{"metric": {}, "value": result}] if data["resultType"] == "scalar" else result

    def exemplars(self, expr: str, seconds: float = 3600.0) -> list[dict[str, Any]]:
        """The exemplars of `expr`'s series over the last `seconds` (each: its `labels`, its
        `value` and `timestamp`), as Grafana asks for a panel target with exemplars on."""
        now = time.time()
        found: list[dict[str, Any]] = []
        for series in self.api(
            "query_exemplars", query=expr, start=str(now - seconds), end=str(now)
        ):  # fmt: skip
            found.extend(series["exemplars"])
        return found

    def label_values(self, metric: str, label: str) -> list[str]:
        values: list[str] = self.api(f"label/{label}/values", **{"match[]": metric})
        return values

    def scrapes(self) -> int:
        """Samples of `up` stored so far for the first target: how many scrapes it took."""
        result = self.query(f"count_over_time(up{{instance={json.dumps(self.targets[0])}}}[1h])")
        return int(float(result[0]["value"][1])) if result else 0


class PrometheusQueryError(RuntimeError):
    """Prometheus refused a query (a parse or an evaluation error)."""
