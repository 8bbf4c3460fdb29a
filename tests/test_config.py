"""ServeConfig: flag > XSP_* environment > TOML file > default, and clear errors."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

import pytest

from sidecar.cli import build_parser
from sidecar.config import (
    ConfigError,
    ServeConfig,
    default_text,
    env_name,
    flag_name,
    load_serve_config,
    parse_endpoint,
    settings,
)
from sidecar.endpoint import Endpoint
from sidecar.trace.spans import REPLAY_LEVELS, Level


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
        ({"http_listen": "0.0.0.0:8010"}, {}, "--http-listen needs --http-backend"),
        ({}, {"XSP_HTTP_BACKEND": "triton:8000"}, "--http-backend needs --http-listen"),
        ({"http_backend": "triton"}, {}, "--http-backend: expected HOST:PORT or unix:PATH"),
        ({"otlp_export": "collector:4318"}, {}, "--otlp-export: expected http://HOST:4318"),
        ({}, {"XSP_REPLAY_DEVICE": "gpu"}, "use auto, cpu, cuda or cuda:N"),
        (
            {"otlp_export": "grpc://c:4317", "otlp_export_protocol": "http"},
            {},
            "cannot be exported to over OTLP/HTTP",
        ),
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


def test_levels_accept_codes_and_names_in_any_case(tmp_path: Path) -> None:
    for text in ("M,L,K", "model, layer, kernel", "k,Layer,MODEL", "M,K,L,M"):
        assert load_serve_config({"levels": text}, env={}).levels == REPLAY_LEVELS
    assert load_serve_config({}, env={"XSP_LEVELS": "kernel"}).levels == (Level.KERNEL,)
    with pytest.raises(ConfigError, match=r"--levels: unknown level 'X'.*got 'M,X'"):
        load_serve_config({"levels": "M,X"}, env={})
    toml = tmp_path / "levels.toml"
    toml.write_text('levels = ","\n')
    with pytest.raises(ConfigError, match=r"levels in .*levels.toml: no levels given"):
        load_serve_config({"config": str(toml)}, env={})


# One value per setting that differs from its default; the test below checks that each is
# read from a flag, an XSP_* variable and the TOML file alike.
SAMPLES: dict[str, str] = {
    "backend": "unix:/run/triton.sock",
    "listen": "127.0.0.1:9011",
    "http_listen": "127.0.0.1:9015",
    "http_backend": "[::1]:8000",
    "metrics_port": "9012",
    "grpc_port": "9013",
    "grace_period": "3.5",
    "idle_timeout": "0",
    "tls_cert": "cert.pem",  # made in the test's folder
    "tls_key": "key.pem",
    "max_models": "7",
    "backend_protocol": "tfserving",
    "model_repository": "models",
    "db": "other.db",
    "otlp_port": "0",
    "otlp_host": "0.0.0.0",
    "sample_rate": "0.5",
    "sample_budget": "60",
    "sample_force_header": "x-force",
    "sample_slow": "250ms",
    "duty_cycle": "0.5",
    "queue_size": "3",
    "levels": "M,L,K",
    "iterations": "4",
    "warmup": "0",
    "replay_device": "cuda:1",
    "replay_python_models": "off",
    "profile_timeout": "30",
    "retention_max_traces": "0",
    "retention_max_mb": "1.5",
    "retention_max_age_hours": "2",
    "store_raw_inputs": "true",
    "admin": "true",
    "admin_listen": "127.0.0.1:9014",
    "otlp_export": "http://collector:4317",
    "otlp_export_protocol": "grpc",
    "tf_profiler_address": "backend",
    "tf_profiler_capture_ms": "50",
    "tf_profiler_dir": "/shared/tf-profiler",
}


def test_every_setting_is_a_flag_an_env_variable_a_toml_key_and_a_help_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = list(settings())
    assert [key for key, _, _ in table] == [f.name for f in fields(ServeConfig)]
    assert set(SAMPLES) == {key for key, _, setting in table if setting.in_file}
    monkeypatch.chdir(tmp_path)
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("pem")
    (tmp_path / "models").mkdir()

    argv: list[str] = []
    for key, default, _ in table:
        if key in SAMPLES:
            switch = isinstance(default, bool)
            argv += [flag_name(key)] if switch else [flag_name(key), SAMPLES[key]]
    from_flags = load_serve_config(flags_from(argv), env={})
    from_env = load_serve_config({}, env={env_name(key): v for key, v in SAMPLES.items()})
    toml = tmp_path / "xsp.toml"
    toml.write_text("".join(f"{key} = {value!r}\n" for key, value in SAMPLES.items()))
    from_file = load_serve_config({"config": str(toml)}, env={})
    assert from_flags == from_env == replace(from_file, config=None)
    for key, default, _ in table:
        if key != "config":
            assert getattr(from_flags, key) != default, key

    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside a help line
    parser, _ = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = commands.choices["serve"]
    flags = {action.dest: action.option_strings for action in serve._actions}
    help_text = " ".join(serve.format_help().split())
    for key, _, setting in table:
        assert flags[key] == [flag_name(key)], key
        assert f"{setting.help} (env {env_name(key)}, default {default_text(key)})" in help_text
    assert "replay levels: M model, L layer, K kernel (env XSP_LEVELS, default M,L)" in help_text
    assert "(env XSP_SAMPLE_RATE, default 0.001)" in help_text
    assert "(env XSP_STORE_RAW_INPUTS, default off)" in help_text
    assert "(env XSP_GRACE_PERIOD, default 10)" in help_text
    assert "(env XSP_HTTP_LISTEN, default '')" in help_text


def test_every_setting_is_in_the_contracts_table() -> None:
    contracts = (Path(__file__).parents[1] / "docs" / "contracts.md").read_text()
    serve_section = contracts.split("## Ports and defaults", 1)[1].split("\n## ", 1)[0]
    for key, _, _ in settings():
        assert f"`{flag_name(key)}" in serve_section, key
        assert f"`{env_name(key)}`" in serve_section, key


def test_replay_device_is_auto_by_default_and_cuda_means_cuda_0() -> None:
    assert load_serve_config({}, env={}).replay_device == "auto"
    assert load_serve_config({}, env={"XSP_REPLAY_DEVICE": "CUDA"}).replay_device == "cuda:0"
    assert load_serve_config(flags_from(["--replay-device", "cpu"]), env={}).replay_device == "cpu"


def test_an_empty_variable_is_unset_except_for_the_force_header() -> None:
    config = load_serve_config({}, env={"XSP_DB": "", "XSP_SAMPLE_FORCE_HEADER": ""})
    assert config.db == ServeConfig().db
    assert config.sample_force_header == ""  # '' switches forcing off


def test_the_http_plane_needs_both_addresses_or_neither(tmp_path: Path) -> None:
    off = load_serve_config({}, env={})
    assert (off.http_listen, off.http_backend, off.http_plane) == ("", "", False)
    on = load_serve_config(
        flags_from(["--http-listen", "0.0.0.0:8010", "--http-backend", "localhost:8000"]), env={}
    )
    assert on.http_plane
    assert on.http_listen_endpoint == Endpoint("0.0.0.0", 8010)
    assert on.http_backend_endpoint == Endpoint("localhost", 8000)
    # the missing one is named, with its environment variable
    with pytest.raises(ConfigError) as info:
        load_serve_config({"http_backend": "localhost:8000"}, env={})
    assert "--http-backend needs --http-listen (env XSP_HTTP_LISTEN) too" in str(info.value)
    # an empty variable switches a file's HTTP plane off, as for the other '' settings
    toml = tmp_path / "xsp.toml"
    toml.write_text('http_listen = "0.0.0.0:8010"\nhttp_backend = "localhost:8000"\n')
    env = {"XSP_CONFIG": str(toml), "XSP_HTTP_LISTEN": "", "XSP_HTTP_BACKEND": ""}
    assert not load_serve_config({}, env=env).http_plane
    assert load_serve_config({}, env={"XSP_CONFIG": str(toml)}).http_plane
