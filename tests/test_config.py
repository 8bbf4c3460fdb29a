"""ServeConfig: flag > XSP_* environment > TOML file > default, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.cli import build_parser
from sidecar.config import ConfigError, ServeConfig, load_serve_config, parse_endpoint
from sidecar.endpoint import Endpoint


def flags_from(argv: list[str]) -> dict[str, object]:
    parser, _ = build_parser()
    return vars(parser.parse_args(["serve", *argv]))


def test_defaults_match_contract() -> None:
    config = load_serve_config({}, env={})
    assert config == ServeConfig()
    assert config.backend_endpoint == Endpoint("localhost", 8001)
    assert config.listen_endpoint == Endpoint("0.0.0.0", 8011)
    assert (config.metrics_port, config.grpc_port, config.grace_period) == (8012, 8013, 10.0)
    assert (config.max_models, config.backend_protocol) == (100, "triton")


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    toml = tmp_path / "xsp.toml"
    toml.write_text('metrics_port = 9000\ngrpc_port = 9001\nmax_models = 5\nbackend = "a:1"\n')
    env = {"XSP_CONFIG": str(toml), "XSP_GRPC_PORT": "7001", "XSP_BACKEND": "b:2"}
    config = load_serve_config(flags_from(["--backend", "c:3"]), env=env)
    assert config.backend == "c:3"  # flag beats env and file
    assert config.grpc_port == 7001  # env beats file
    assert config.metrics_port == 9000  # file beats default
    assert config.max_models == 5
    assert config.listen == "0.0.0.0:8011"  # default
    assert config.config == toml


def test_config_flag_beats_env_for_the_file(tmp_path: Path) -> None:
    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    one.write_text("max_models = 1\n")
    two.write_text("max_models = 2\n")
    config = load_serve_config({"config": str(two)}, env={"XSP_CONFIG": str(one)})
    assert config.max_models == 2


def test_backend_forms() -> None:
    assert parse_endpoint("unix:/tmp/t.sock") == Endpoint(unix_path="/tmp/t.sock")
    assert parse_endpoint("unix:///tmp/t.sock") == Endpoint(unix_path="/tmp/t.sock")
    assert parse_endpoint("[::1]:8001") == Endpoint("::1", 8001)
    config = load_serve_config(flags_from(["--backend", "unix:/run/triton.sock"]), env={})
    assert config.backend_endpoint.unix_path == "/run/triton.sock"


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"metrics_port": "abc"}, {}, "--metrics-port: expected a port number, got 'abc'"),
        ({}, {"XSP_GRPC_PORT": "70000"}, "XSP_GRPC_PORT (environment): port 70000 is outside"),
        ({"backend": "nohostport"}, {}, "--backend: expected HOST:PORT or unix:PATH"),
        ({"max_models": "0"}, {}, "--max-models: must be at least 1"),
        ({"grace_period": "-1"}, {}, "--grace-period: must be zero or more seconds"),
        ({}, {"XSP_BACKEND_PROTOCOL": "http"}, "expected one of triton, tfserving"),
        ({"tls_cert": "/nonexistent.pem"}, {}, "TLS needs both --tls-cert and --tls-key"),
        (
            {"tls_cert": "/no.pem", "tls_key": "/no.key"},
            {},
            "--tls-cert: /no.pem is not a readable",
        ),
        ({"config": "/nonexistent.toml"}, {}, "config file /nonexistent.toml does not exist"),
    ],
)
def test_errors_are_clear(flags: dict[str, str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_serve_config(flags, env=env)
    assert message in str(info.value)


def test_bad_toml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("metrics_port = \n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_serve_config({"config": str(bad)}, env={})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("metric_port = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key.*metric_port.*known keys"):
        load_serve_config({"config": str(unknown)}, env={})
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text('metrics_port = "x"\n')
    with pytest.raises(ConfigError, match=r"metrics_port in .*type.toml: expected a port number"):
        load_serve_config({"config": str(wrong_type)}, env={})


def test_config_is_frozen() -> None:
    config = ServeConfig()
    with pytest.raises(AttributeError):
        config.backend = "x:1"  # type: ignore[misc]


def test_serve_command_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar.cli import main

    assert main(["serve", "--metrics-port", "nope"]) == 2
    assert (
        "xsp-sidecar serve: error: --metrics-port: expected a port number"
        in capsys.readouterr().err
    )
