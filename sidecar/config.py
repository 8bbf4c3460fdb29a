"""`xsp-sidecar serve` configuration: one frozen object from flags, environment and TOML.

Precedence: command-line flag > `XSP_*` environment variable > TOML file (`--config`) >
default (docs/contracts.md). Every bad value is reported as a `ConfigError` that says which
setting, where it came from and what is expected.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sidecar.endpoint import Endpoint

BACKEND_PROTOCOLS = ("triton", "tfserving")


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class ServeConfig:
    """Settings of `xsp-sidecar serve` (see docs/contracts.md)."""

    backend: str = "localhost:8001"
    listen: str = "0.0.0.0:8011"
    metrics_port: int = 8012
    grpc_port: int = 8013
    config: Path | None = None
    grace_period: float = 10.0
    idle_timeout: float = 300.0  # 0 = never close idle client connections
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_models: int = 100
    backend_protocol: str = "triton"
    # sampling and profiling
    model_repository: Path | None = None
    db: Path = Path("xsp-traces.db")
    otlp_port: int = 4318
    otlp_host: str = "127.0.0.1"
    sample_rate: float = 0.001
    sample_budget: float = 6.0
    sample_force_header: str = "x-xsp-profile"
    duty_cycle: float = 0.05
    queue_size: int = 8
    levels: str = "M,L"
    iterations: int = 10
    warmup: int = 2
    profile_timeout: float = 120.0
    retention_max_traces: int = 1000
    retention_max_mb: float = 512.0
    retention_max_age_hours: float = 168.0
    store_raw_inputs: bool = False
    admin: bool = False
    admin_listen: str = "127.0.0.1:8014"

    @property
    def backend_endpoint(self) -> Endpoint:
        return parse_endpoint(self.backend, "backend")

    @property
    def listen_endpoint(self) -> Endpoint:
        return parse_endpoint(self.listen, "listen")


def parse_endpoint(text: str, setting: str = "address") -> Endpoint:
    """Parse `HOST:PORT`, `[IPv6]:PORT` or `unix:PATH`."""
    text = text.strip()
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):  # gRPC's unix:///abs/path form
            path = path[2:]
        if not path:
            raise ConfigError(f"{setting}: 'unix:' needs a socket path, e.g. unix:/tmp/triton.sock")
        return Endpoint(unix_path=path)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{setting}: expected HOST:PORT or unix:PATH, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return Endpoint(host, _port(port_text, setting, allow_zero=True))


def _port(value: Any, setting: str, allow_zero: bool = False) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: expected a port number, got {value!r}") from None
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise ConfigError(f"{setting}: port {port} is outside {low}..65535")
    return port


def _positive_int(value: Any, setting: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: expected a whole number, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{setting}: must be at least 1, got {number}")
    return number


def _seconds(value: Any, setting: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: expected a number of seconds, got {value!r}") from None
    if not number >= 0:
        raise ConfigError(f"{setting}: must be zero or more seconds, got {value!r}")
    return number


def _address(value: Any, setting: str) -> str:
    text = str(value)
    parse_endpoint(text, setting)
    return text


def _protocol(value: Any, setting: str) -> str:
    text = str(value).lower()
    if text not in BACKEND_PROTOCOLS:
        raise ConfigError(
            f"{setting}: expected one of {', '.join(BACKEND_PROTOCOLS)}, got {value!r}"
        )
    return text


def _path(value: Any, setting: str) -> Path:
    return Path(str(value)).expanduser()


def _fraction(value: Any, setting: str, allow_zero: bool = True) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: expected a number between 0 and 1, got {value!r}") from None
    if not (0.0 <= number <= 1.0) or (number == 0.0 and not allow_zero):
        low = "0" if allow_zero else "more than 0"
        raise ConfigError(f"{setting}: must be from {low} to 1, got {value!r}")
    return number


def _non_negative(value: Any, setting: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: expected a number, got {value!r}") from None
    if not number >= 0:
        raise ConfigError(f"{setting}: must be zero or more, got {value!r}")
    return number


def _finite(number: float, setting: str) -> float:
    if number == float("inf"):
        raise ConfigError(f"{setting}: must be a finite number, got {number}")
    return number


def _at_least(number: float, low: float, setting: str) -> float:
    if number < low:
        raise ConfigError(f"{setting}: must be at least {low:g}, got {number:g}")
    return number


def _whole(value: Any, setting: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: expected a whole number, got {value!r}") from None
    if number < 0:
        raise ConfigError(f"{setting}: must be zero or more, got {number}")
    return number


def _bool(value: Any, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{setting}: expected true or false, got {value!r}")


def _levels(value: Any, setting: str) -> str:
    codes = [c.strip().upper() for c in str(value).split(",") if c.strip()]
    bad = [c for c in codes if c not in ("M", "L", "K")]
    if not codes or bad:
        raise ConfigError(f"{setting}: expected levels from M, L, K such as M,L; got {value!r}")
    return ",".join(dict.fromkeys(codes))


def _header(value: Any, setting: str) -> str:
    text = str(value).strip().lower()
    if text and not all(c.isalnum() or c in "-_." for c in text):
        raise ConfigError(f"{setting}: {value!r} is not a valid gRPC metadata key")
    return text


_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "backend": _address,
    "listen": _address,
    "metrics_port": lambda v, s: _port(v, s, allow_zero=True),
    "grpc_port": lambda v, s: _port(v, s, allow_zero=True),
    "grace_period": _seconds,
    "idle_timeout": _seconds,
    "tls_cert": _path,
    "tls_key": _path,
    "max_models": _positive_int,
    "backend_protocol": _protocol,
    "model_repository": _path,
    "db": _path,
    "otlp_port": lambda v, s: _port(v, s, allow_zero=True),
    "otlp_host": lambda v, s: str(v),
    "sample_rate": _fraction,
    "sample_budget": lambda v, s: _finite(_non_negative(v, s), s),
    "sample_force_header": _header,
    "duty_cycle": lambda v, s: _at_least(_fraction(v, s, allow_zero=False), 0.001, s),
    "queue_size": _positive_int,
    "levels": _levels,
    "iterations": _positive_int,
    "warmup": _whole,
    "profile_timeout": _seconds,
    "retention_max_traces": _whole,
    "retention_max_mb": _non_negative,
    "retention_max_age_hours": _non_negative,
    "store_raw_inputs": _bool,
    "admin": _bool,
    "admin_listen": _address,
}


def env_name(key: str) -> str:
    return "XSP_" + key.upper()


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def read_toml(path: Path) -> dict[str, Any]:
    """Read a TOML config file; keys are the flag names with `_`."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    unknown = sorted(set(data) - set(_PARSERS))
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(sorted(_PARSERS))}"
        )
    return data


def load_serve_config(
    flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> ServeConfig:
    """Build the config. `flags` maps keys to values, None meaning 'not given on the CLI'."""
    flags = dict(flags or {})
    env = os.environ if env is None else env
    config_value = flags.get("config") or env.get(env_name("config")) or None
    config_path = Path(config_value).expanduser() if config_value else None
    file_values = read_toml(config_path) if config_path is not None else {}
    values: dict[str, Any] = {"config": config_path}
    for key, parse in _PARSERS.items():
        if flags.get(key) is not None and flags.get(key) is not False:
            raw, where = flags[key], f"{flag_name(key)}"
        elif env.get(env_name(key)) is not None and (
            env[env_name(key)] != "" or key == "sample_force_header"
        ):
            raw, where = env[env_name(key)], f"{env_name(key)} (environment)"
        elif key in file_values:
            raw, where = file_values[key], f"{key} in {config_path}"
        else:
            continue
        values[key] = parse(raw, where)
    config = ServeConfig(**values)
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("TLS needs both --tls-cert and --tls-key (or neither)")
    if config.model_repository is not None and not config.model_repository.is_dir():
        raise ConfigError(
            f"--model-repository: {config.model_repository} is not a directory "
            "(mount the backend's model repository read-only and point here)"
        )
    for name in ("tls_cert", "tls_key"):
        path = getattr(config, name)
        if path is not None and not path.is_file():
            raise ConfigError(f"{flag_name(name)}: {path} is not a readable file")
    return config


CONFIG_KEYS = tuple(f.name for f in fields(ServeConfig))
