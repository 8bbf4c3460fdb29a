"""`xsp-sidecar serve` configuration: one frozen object from flags, environment and TOML.

`ServeConfig` is the one table of settings: each field holds its default and, as a `Setting`,
its parser, help text and place in `--help`. The flag (`--metrics-port`), the environment
variable (`XSP_METRICS_PORT`), the TOML key (`metrics_port`) and the help line (ending in
"(env XSP_METRICS_PORT, default 8012)") are all derived from it, so a new setting is one entry
here plus its use (and the Helm chart).

Precedence: command-line flag > `XSP_*` environment variable > TOML file (`--config`) >
default (docs/contracts.md). Every bad value is reported as a `ConfigError` that says which
setting, where it came from and what is expected.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from sidecar import config_parsers as parsers
from sidecar.backends import BACKENDS
from sidecar.config_parsers import ConfigError
from sidecar.endpoint import Endpoint
from sidecar.profiling.levels import format_levels
from sidecar.trace.otlp_target import OTLP_PROTOCOLS, OtlpExportError, parse_target
from sidecar.trace.spans import Level

GENERAL = "options"  # the groups of `serve --help`
SAMPLING = "sampling and profiling"


@dataclass(frozen=True)
class Setting:
    """One row of the settings table: how a `ServeConfig` field is read and shown. A bool
    setting is a flag without a value (`--admin`); env and TOML take true/false."""

    parse: Callable[[Any, str], Any]  # (value, where it came from) -> value, or ConfigError
    help: str
    metavar: str | None = None
    group: str = GENERAL
    choices: tuple[str, ...] = ()
    empty_env: bool = False  # an empty XSP_* value is a value, not "unset"
    in_file: bool = True  # a key of the TOML file


def row(
    parse: Callable[[Any, str], Any], metavar: str | None, help: str, **options: Any
) -> dict[str, Setting]:
    """The `field(metadata=...)` of a general setting."""
    return {"setting": Setting(parse, help, metavar, **options)}


def sampling(
    parse: Callable[[Any, str], Any], metavar: str | None, help: str, **options: Any
) -> dict[str, Setting]:
    """The `field(metadata=...)` of a sampling and profiling setting."""
    return row(parse, metavar, help, group=SAMPLING, **options)


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
    return Endpoint(host, parsers.port(port_text, setting, allow_zero=True))


def _address(value: Any, setting: str) -> str:
    text = str(value)
    parse_endpoint(text, setting)
    return text


def _optional_address(value: Any, setting: str) -> str:
    """'' (off) or `HOST:PORT`."""
    text = str(value).strip()
    return text and _address(text, setting)


TF_PROFILER_AT_BACKEND = "backend"  # --tf-profiler-address: the backend's own gRPC port


def _profiler_address(value: Any, setting: str) -> str:
    """'' (off), 'backend' or an address."""
    text = str(value).strip()
    return text if text in ("", TF_PROFILER_AT_BACKEND) else _address(text, setting)


def _otlp_url(value: Any, setting: str) -> str:
    """'' (off) or an OTLP endpoint URL."""
    text = str(value).strip()
    if text:
        try:
            parse_target(text, "grpc" if text.startswith("grpc:") else "http")
        except OtlpExportError as exc:
            raise ConfigError(f"{setting}: {exc}") from None
    return text


def _otlp_protocol(value: Any, setting: str) -> str:
    name = str(value).strip().lower()
    if name not in OTLP_PROTOCOLS:
        raise ConfigError(f"{setting}: expected one of {', '.join(OTLP_PROTOCOLS)}, got {value!r}")
    return name


def _on_off(value: Any, setting: str) -> Literal["on", "off"]:
    """`on` or `off` (true/false, yes/no and 1/0 too, as TOML booleans)."""
    return "on" if parsers.boolean(value, setting) else "off"


@dataclass(frozen=True)
class ServeConfig:
    """Settings of `xsp-sidecar serve` (see docs/contracts.md), one field each."""

    backend: str = field(
        default="localhost:8001",
        metadata=row(_address, "HOST:PORT|unix:PATH", "the model server's gRPC endpoint"),
    )
    listen: str = field(
        default="0.0.0.0:8011", metadata=row(_address, "HOST:PORT", "relay address clients call")
    )
    http_listen: str = field(
        default="",
        metadata=row(
            _optional_address,
            "HOST:PORT",
            "relay address REST clients call (KServe v2 HTTP, TF-Serving REST); with "
            "--http-backend; '' = no HTTP plane",
            empty_env=True,
        ),
    )
    http_backend: str = field(
        default="",
        metadata=row(
            _optional_address,
            "HOST:PORT",
            "the model server's REST endpoint (Triton's 8000, TF-Serving's 8501); with "
            "--http-listen; '' = no HTTP plane",
            empty_env=True,
        ),
    )
    metrics_port: int = field(
        default=8012, metadata=row(parsers.any_port, "N", "Prometheus /metrics HTTP port")
    )
    grpc_port: int = field(
        default=8013,
        metadata=row(
            parsers.any_port, "N", "port of the sidecar's health + reflection gRPC services"
        ),
    )
    config: Path | None = field(
        default=None,
        metadata=row(
            parsers.path,
            "FILE",
            "TOML file with keys named like the flags, e.g. metrics_port = 9000",
            in_file=False,
        ),
    )
    grace_period: float = field(
        default=10.0,
        metadata=row(
            parsers.seconds, "S", "seconds in-flight calls may take to finish after SIGTERM"
        ),
    )
    idle_timeout: float = field(
        default=300.0,
        metadata=row(
            parsers.seconds,
            "S",
            "close a client connection with no call in flight for this long (gRPC: with a "
            "GOAWAY; HTTP: after its last response); 0 = never",
        ),
    )
    tls_cert: Path | None = field(
        default=None,
        metadata=row(
            parsers.path,
            "PEM",
            "terminate TLS on the client side (gRPC and HTTP ports) with this certificate",
        ),
    )
    tls_key: Path | None = field(
        default=None, metadata=row(parsers.path, "PEM", "private key for --tls-cert")
    )
    max_models: int = field(
        default=100,
        metadata=row(
            parsers.positive_int,
            "N",
            "distinct model label values tracked; the rest count as _other",
        ),
    )
    backend_protocol: str = field(
        default="triton",
        metadata=row(
            parsers.protocol,
            None,
            "backend kind, for the readiness check",
            choices=tuple(BACKENDS),
        ),
    )
    model_repository: Path | None = field(
        default=None,
        metadata=sampling(
            parsers.path,
            "PATH",
            "the backend's model repository (Triton layout), mounted read-only; "
            "sampling is off without it",
        ),
    )
    db: Path = field(
        default=Path("xsp-traces.db"),
        metadata=sampling(parsers.path, "PATH", "SQLite trace database"),
    )
    otlp_port: int = field(
        default=4318,
        metadata=sampling(
            parsers.any_port, "N", "OTLP/HTTP port receiving the backend's spans; 0 turns it off"
        ),
    )
    otlp_host: str = field(
        default="127.0.0.1",
        metadata=sampling(
            parsers.text, "HOST", "address the OTLP receiver binds; the backend is in the pod"
        ),
    )
    sample_rate: float = field(
        default=0.001,
        metadata=sampling(parsers.fraction, "P", "probability that a request is profiled"),
    )
    sample_budget: float = field(
        default=6.0,
        metadata=sampling(
            parsers.finite_non_negative,
            "N",
            "at most N profiles per minute per model, a token bucket",
        ),
    )
    sample_force_header: str = field(
        default="x-xsp-profile",
        metadata=sampling(
            parsers.header,
            "NAME",
            "metadata key whose value 1 forces a sample; '' disables",
            empty_env=True,
        ),
    )
    sample_slow: float | Literal["off", "p99"] = field(
        default="off",
        metadata=sampling(
            parsers.sample_slow,
            "MS|p99",
            "also profile requests the rate did not pick whose response took longer than MS "
            "milliseconds, or than the model's rolling p99 (p99; after 100 responses); off",
        ),
    )
    duty_cycle: float = field(
        default=0.05,
        metadata=sampling(
            parsers.duty_cycle, "F", "max fraction of wall time the profiling worker may be busy"
        ),
    )
    queue_size: int = field(
        default=8,
        metadata=sampling(
            parsers.positive_int,
            "N",
            "sampled requests that may wait for the worker; more are dropped",
        ),
    )
    levels: tuple[Level, ...] = field(
        default=(Level.MODEL, Level.LAYER),
        metadata=sampling(
            parsers.levels,
            "M,L,K",
            "replay levels: M model, L layer, K kernel",
        ),
    )
    iterations: int = field(
        default=10,
        metadata=sampling(parsers.positive_int, "N", "timed iterations per leveled run"),
    )
    warmup: int = field(
        default=2, metadata=sampling(parsers.whole, "N", "warm-up iterations per leveled run")
    )
    replay_device: str = field(
        default="auto",
        metadata=sampling(
            parsers.replay_device,
            "auto|cpu|cuda[:N]",
            "where sampled requests are replayed; auto: the GPU when the model's config.pbtxt "
            "asks for KIND_GPU and CUDA is visible to the profiling worker, else the CPU",
        ),
    )
    replay_python_models: Literal["on", "off"] = field(
        default="on",
        metadata=sampling(
            _on_off,
            None,
            "replay a Triton Python-backend model by running its own model.py in the profiling "
            "worker (the repository's code, as Triton runs it); off: such models are live-only",
            choices=("on", "off"),
        ),
    )
    profile_timeout: float = field(
        default=120.0,
        metadata=sampling(
            parsers.seconds, "S", "a profile running longer is killed and counted as a timeout"
        ),
    )
    retention_max_traces: int = field(
        default=1000,
        metadata=sampling(parsers.whole, "N", "keep at most N traces; 0 = no limit"),
    )
    retention_max_mb: float = field(
        default=512.0,
        metadata=sampling(parsers.non_negative, "MB", "keep the database under MB; 0 = no limit"),
    )
    retention_max_age_hours: float = field(
        default=168.0,
        metadata=sampling(
            parsers.non_negative, "H", "delete traces older than H hours; 0 = no limit"
        ),
    )
    store_raw_inputs: bool = field(
        default=False,
        metadata=sampling(
            parsers.boolean,
            None,
            "keep raw input tensors in traces; otherwise only shapes, dtypes and a digest",
        ),
    )
    admin: bool = field(
        default=False,
        metadata=sampling(
            parsers.boolean,
            None,
            "serve the xsp.v1.Profiler admin API: trigger profiles, list traces, change sampling",
        ),
    )
    admin_listen: str = field(
        default="127.0.0.1:8014",
        metadata=sampling(_address, "HOST:PORT", "admin API address; localhost only by default"),
    )

    otlp_export: str = field(
        default="",
        metadata=sampling(
            _otlp_url,
            "URL",
            "also export every stored trace to this OTLP endpoint (Collector, Jaeger, Tempo): "
            "http://HOST:4318/v1/traces (OTLP/HTTP) or grpc://HOST:4317; '' = off",
            empty_env=True,
        ),
    )
    otlp_export_protocol: str = field(
        default="auto",
        metadata=sampling(
            _otlp_protocol,
            None,
            "protocol of --otlp-export; auto: grpc:// is gRPC, http(s):// is OTLP/HTTP",
            choices=OTLP_PROTOCOLS,
        ),
    )

    tf_profiler_address: str = field(
        default="",
        metadata=sampling(
            _profiler_address,
            "HOST:PORT",
            "TensorFlow ProfilerService that captures the server's side of sampled TF-Serving "
            "requests; 'backend' = the backend's gRPC port (TF-Serving serves it); '' = off",
            empty_env=True,
        ),
    )
    tf_profiler_capture_ms: int = field(
        default=200,
        metadata=sampling(
            parsers.positive_int, "MS", "length of the backend's capture around a sampled request"
        ),
    )
    tf_profiler_dir: Path = field(
        default=Path("/tmp/xsp-tf-profiler"),
        metadata=sampling(
            parsers.path,
            "PATH",
            "folder the backend writes its captures to and the sidecar reads them from "
            "(shared by both containers)",
        ),
    )

    @property
    def backend_endpoint(self) -> Endpoint:
        return parse_endpoint(self.backend, "backend")

    @property
    def listen_endpoint(self) -> Endpoint:
        return parse_endpoint(self.listen, "listen")

    @property
    def http_plane(self) -> bool:
        """Whether REST traffic is relayed too (--http-listen and --http-backend given)."""
        return bool(self.http_listen and self.http_backend)

    @property
    def http_listen_endpoint(self) -> Endpoint:
        return parse_endpoint(self.http_listen, "http-listen")

    @property
    def http_backend_endpoint(self) -> Endpoint:
        return parse_endpoint(self.http_backend, "http-backend")


def settings() -> Iterator[tuple[str, Any, Setting]]:
    """The table: (key, default, setting) of every `ServeConfig` field, in order."""
    for item in fields(ServeConfig):
        yield item.name, item.default, item.metadata["setting"]


def default_text(key: str) -> str:
    """How `--help` writes a setting's default."""
    default = next(d for k, d, _ in settings() if k == key)
    if default is None:
        return "none"
    if default == "":
        return "''"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, tuple):  # levels
        return format_levels(default)
    return str(default)


def env_name(key: str) -> str:
    return "XSP_" + key.upper()


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


CONFIG_KEYS = tuple(key for key, _, _ in settings())
FILE_KEYS = tuple(key for key, _, setting in settings() if setting.in_file)


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
    unknown = sorted(set(data) - set(FILE_KEYS))
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(sorted(FILE_KEYS))}"
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
    for key, _, setting in settings():
        if not setting.in_file:
            continue  # --config itself, read above
        env_value = env.get(env_name(key))
        if flags.get(key) is not None and flags.get(key) is not False:
            raw, where = flags[key], f"{flag_name(key)}"
        elif env_value is not None and (env_value != "" or setting.empty_env):
            raw, where = env_value, f"{env_name(key)} (environment)"
        elif key in file_values:
            raw, where = file_values[key], f"{key} in {config_path}"
        else:
            continue
        values[key] = setting.parse(raw, where)
    config = ServeConfig(**values)
    check_http_plane(config)
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("TLS needs both --tls-cert and --tls-key (or neither)")
    if config.model_repository is not None and not config.model_repository.is_dir():
        raise ConfigError(
            f"--model-repository: {config.model_repository} is not a directory "
            "(mount the backend's model repository read-only and point here)"
        )
    if config.otlp_export:
        try:
            parse_target(config.otlp_export, config.otlp_export_protocol)
        except OtlpExportError as exc:
            raise ConfigError(f"--otlp-export: {exc}") from None
    for name in ("tls_cert", "tls_key"):
        path = getattr(config, name)
        if path is not None and not path.is_file():
            raise ConfigError(f"{flag_name(name)}: {path} is not a readable file")
    return config


def check_http_plane(config: ServeConfig) -> None:
    """The HTTP plane needs both of its addresses, or neither."""
    given = [name for name in ("http_listen", "http_backend") if getattr(config, name)]
    if len(given) == 1:
        (have,) = given
        missing = "http_backend" if have == "http_listen" else "http_listen"
        raise ConfigError(
            f"{flag_name(have)} needs {flag_name(missing)} (env {env_name(missing)}) too: the "
            "HTTP plane relays REST calls from the one to the other; give both, or neither "
            "for no HTTP plane"
        )
