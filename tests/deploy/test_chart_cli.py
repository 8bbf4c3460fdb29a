"""The command line the chart gives the sidecar is one the sidecar accepts."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.cli import build_parser
from tests.deploy.helpers import contract_flags, load_values_file, manifests, one, render

# Named by the proxy work (TF-Serving relay) but not yet listed in docs/contracts.md.
FLAGS_OUTSIDE_CONTRACTS = {"--backend-protocol"}
# "Later (sampling)" flags of docs/contracts.md: the serve command may not accept them yet.
LATER = ("--model-repository", "--db", "--otlp-port", "--sample-rate", "--sample-budget", "--admin")
FULL: dict[str, Any] = {"sidecar": {"admin": {"enabled": True}}}


def _sidecar_argv(values: dict[str, Any] | None) -> list[str]:
    deployment = one(manifests(render(values)), "Deployment")
    [sidecar] = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "sidecar"
    ]
    assert sidecar["command"] == ["xsp-sidecar"]
    return list(sidecar["args"])


@pytest.mark.parametrize("values", [None, load_values_file("values-tfserving.yaml"), FULL])
def test_every_flag_is_a_contract_flag(values: dict[str, Any] | None) -> None:
    argv = _sidecar_argv(values)
    used = {a.split("=", 1)[0] for a in argv if a.startswith("--")} - {"--log-level"}
    unknown = used - contract_flags() - FLAGS_OUTSIDE_CONTRACTS
    assert not unknown, f"flags not in docs/contracts.md: {sorted(unknown)}"


@pytest.mark.parametrize("values", [None, load_values_file("values-tfserving.yaml"), FULL])
def test_the_real_cli_parses_the_chart_arguments(values: dict[str, Any] | None) -> None:
    parser, commands = build_parser()
    if "serve" not in commands:
        pytest.skip("the `serve` command is not built yet (sidecar/commands/serve.py)")
    args, unknown = parser.parse_known_args(_sidecar_argv(values))
    assert args.command == "serve"
    not_built = [a for a in unknown if a.split("=", 1)[0] in LATER]
    wrong = [a for a in unknown if a not in not_built]
    assert not wrong, f"`xsp-sidecar serve` rejects {wrong}"
    if not_built:
        pytest.skip(f"`serve` does not take these contract flags yet: {not_built}")
