"""`xsp-sidecar serve`: relay gRPC traffic to the backend and export metrics."""

from __future__ import annotations

import argparse
import logging
import sys

from sidecar.config import BACKEND_PROTOCOLS, CONFIG_KEYS, ConfigError, load_serve_config

NAME = "serve"
HELP = (
    "relay gRPC traffic to Triton / TF-Serving unchanged, export Prometheus metrics, and "
    "profile a sample of live requests into SQLite traces"
)

log = logging.getLogger(__name__)

_KEYS = CONFIG_KEYS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults are None so that environment and TOML values can fill the gaps (flag > env >
    # file > default); the documented defaults live in sidecar.config.ServeConfig.
    add = parser.add_argument
    add(
        "--backend",
        metavar="HOST:PORT|unix:PATH",
        help="the model server's gRPC endpoint (env XSP_BACKEND, default localhost:8001)",
    )
    add(
        "--listen",
        metavar="HOST:PORT",
        help="relay address clients call (env XSP_LISTEN, default 0.0.0.0:8011)",
    )
    add(
        "--metrics-port",
        metavar="N",
        help="Prometheus /metrics HTTP port (env XSP_METRICS_PORT, default 8012)",
    )
    add(
        "--grpc-port",
        metavar="N",
        help="port of the sidecar's health + reflection gRPC services "
        "(env XSP_GRPC_PORT, default 8013)",
    )
    add(
        "--config",
        metavar="FILE",
        help="TOML file with keys named like the flags, e.g. metrics_port = 9000 (env XSP_CONFIG)",
    )
    add(
        "--grace-period",
        metavar="S",
        help="seconds in-flight calls may take to finish after SIGTERM "
        "(env XSP_GRACE_PERIOD, default 10)",
    )
    add(
        "--idle-timeout",
        metavar="S",
        help="close a client connection with no call in flight for this long, with a GOAWAY "
        "(env XSP_IDLE_TIMEOUT, default 300; 0 = never)",
    )
    add("--tls-cert", metavar="PEM", help="terminate TLS on the client side with this certificate")
    add("--tls-key", metavar="PEM", help="private key for --tls-cert")
    add(
        "--max-models",
        metavar="N",
        help="distinct model label values tracked; the rest count as _other "
        "(env XSP_MAX_MODELS, default 100)",
    )
    add(
        "--backend-protocol",
        choices=BACKEND_PROTOCOLS,
        type=str.lower,
        help="backend kind, for the readiness check (env XSP_BACKEND_PROTOCOL, default triton)",
    )
    _add_sampling_arguments(parser)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling and profiling",
        "A sampled request is replayed on a local runtime with leveled profiling (model, "
        "layer, kernel) in a separate low-priority process and stored in SQLite. Sampling "
        "is off without --model-repository. Every flag also reads XSP_<NAME> and the TOML file.",
    )
    add = group.add_argument
    add(
        "--model-repository",
        metavar="PATH",
        help="the backend's model repository (Triton layout), mounted read-only",
    )
    add("--db", metavar="PATH", help="SQLite trace database (default xsp-traces.db)")
    add(
        "--otlp-port",
        metavar="N",
        help="OTLP/HTTP port receiving the backend's spans; 0 turns it off (default 4318)",
    )
    add(
        "--otlp-host",
        metavar="HOST",
        help="address the OTLP receiver binds (default 127.0.0.1: the backend is in the pod)",
    )
    add("--sample-rate", metavar="P", help="probability that a request is profiled (default 0.001)")
    add(
        "--sample-budget",
        metavar="N",
        help="at most N profiles per minute per model (token bucket; default 6)",
    )
    add(
        "--sample-force-header",
        metavar="NAME",
        help="metadata key whose value 1 forces a sample; '' disables (default x-xsp-profile)",
    )
    add(
        "--duty-cycle",
        metavar="F",
        help="max fraction of wall time the profiling worker may be busy (default 0.05)",
    )
    add(
        "--queue-size",
        metavar="N",
        help="sampled requests that may wait for the worker; more are dropped (default 8)",
    )
    add("--levels", metavar="M,L,K", help="replay levels: M model, L layer, K kernel (default M,L)")
    add("--iterations", metavar="N", help="timed iterations per leveled run (default 10)")
    add("--warmup", metavar="N", help="warm-up iterations per leveled run (default 2)")
    add(
        "--profile-timeout",
        metavar="S",
        help="a profile running longer is killed and counted as a timeout (default 120)",
    )
    add("--retention-max-traces", metavar="N", help="keep at most N traces; 0 = no limit (1000)")
    add("--retention-max-mb", metavar="MB", help="keep the database under MB; 0 = no limit (512)")
    add(
        "--retention-max-age-hours",
        metavar="H",
        help="delete traces older than H hours; 0 = no limit (168)",
    )
    add(
        "--store-raw-inputs",
        action="store_true",
        default=None,
        help="keep raw input tensors in traces (default: only shapes, dtypes and a digest)",
    )
    add(
        "--admin",
        action="store_true",
        default=None,
        help="serve the xsp.v1.Profiler admin API (trigger profiles, list traces, sampling)",
    )
    add(
        "--admin-listen",
        metavar="HOST:PORT",
        help="admin API address (default 127.0.0.1:8014, localhost only)",
    )


def run(args: argparse.Namespace) -> int:
    flags = {key: getattr(args, key, None) for key in _KEYS}
    try:
        config = load_serve_config(flags)
    except ConfigError as exc:
        print(f"xsp-sidecar serve: error: {exc}", file=sys.stderr)
        return 2
    from sidecar.serve import run_sidecar

    return run_sidecar(config)
