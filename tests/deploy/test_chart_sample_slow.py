"""`sidecar.sampling.sampleSlow` reaches `--sample-slow`, which the sidecar parses; the schema
refuses what the sidecar would refuse."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from sidecar.config_parsers import sample_slow
from tests.deploy.helpers import CHART, container, flag_values, manifests, one, render


def _flag(values: dict[str, Any] | None) -> str:
    args = container(one(manifests(render(values)), "Deployment"), "sidecar")["args"]
    return flag_values(args[args.index("serve") + 1 :])["--sample-slow"]


def _slow(value: object) -> dict[str, Any]:
    return {"sidecar": {"sampling": {"sampleSlow": value}}}


def test_sample_slow_is_off_by_default_as_in_the_contract() -> None:
    assert _flag(None) == "off"


@pytest.mark.parametrize(
    ("value", "flag", "parsed"),
    [("p99", "p99", "p99"), (250, "250", 250.0), ("12.5ms", "12.5ms", 12.5), (0.5, "0.5", 0.5)],
)
def test_each_form_reaches_the_flag_and_the_sidecar_parses_it(
    value: object, flag: str, parsed: object
) -> None:
    assert _flag(_slow(value)) == flag
    assert sample_slow(flag, "--sample-slow") == parsed


@pytest.mark.parametrize("value", ["p95", "slow", "-5", 0, -1, "10s"])
def test_the_schema_refuses_a_value_the_sidecar_would_refuse(value: object) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(chart.merge_values(_slow(value)))
    assert "/sidecar/sampling/sampleSlow" in str(caught.value)
