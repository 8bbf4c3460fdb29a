"""The command line the chart gives the sidecar is one the sidecar accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.cli import build_parser
from sidecar.config import CONFIG_KEYS, load_serve_config
from sidecar.profiling.levels import format_levels
from tests.deploy.helpers import (
    contract_flags,
    flag_values,
    load_values_file,
    manifests,
    one,
    render,
)

FULL: dict[str, Any] = {
    "sidecar": {
        "admin": {"enabled": True, "host": "::1", "port": 9014},
        "otlpHost": "0.0.0.0",
        "sampling": {"forceHeader": "", "dutyCycle": 1, "queueSize": 1},
        "profiling": {"levels": "M,L,K", "iterations": 1000000, "warmup": 0},
        "traceStore": {
            "retention": {"maxTraces": 0, "maxMB": 0.5, "maxAgeHours": 0},
            "storeRawInputs": True,
        },
    }
}
VALUES = [None, load_values_file("values-tfserving.yaml"), FULL]


def _sidecar_argv(values: dict[str, Any] | None) -> list[str]:
    deployment = one(manifests(render(values)), "Deployment")
    [sidecar] = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"
    ]
    assert sidecar["command"] == ["xsp-sidecar"]
    return list(sidecar["args"])


@pytest.mark.parametrize("values", VALUES)
def test_every_flag_is_a_contract_flag(values: dict[str, Any] | None) -> None:
    argv = _sidecar_argv(values)
    used = {a.split("=", 1)[0] for a in argv if a.startswith("--")} - {"--log-level"}
    unknown = used - contract_flags()
    assert not unknown, f"flags not in docs/contracts.md: {sorted(unknown)}"


@pytest.mark.parametrize("values", VALUES)
def test_the_real_cli_parses_the_chart_arguments(
    values: dict[str, Any] | None, tmp_path: Path
) -> None:
    """`xsp-sidecar serve` accepts every argument and its config loader every value."""
    parser, _ = build_parser()
    argv = _sidecar_argv(values)
    args = parser.parse_args(argv)  # exits on an unknown flag or a bad choice
    assert args.command == "serve"
    flags = {key: getattr(args, key, None) for key in CONFIG_KEYS}
    flags["model_repository"] = str(tmp_path)  # the pod's mount, a directory here
    config = load_serve_config(flags, env={})
    chart_flags = flag_values(argv[argv.index("serve") + 1 :])
    assert format_levels(config.levels) == chart_flags["--levels"]
    assert config.admin == ("--admin" in chart_flags)
    assert config.store_raw_inputs == ("--store-raw-inputs" in chart_flags)
    if values is FULL:
        assert config.admin_listen == "[::1]:9014"
        assert config.sample_force_header == ""
        assert config.iterations == 1000000 and config.retention_max_mb == 0.5
