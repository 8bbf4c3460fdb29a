"""`xsp-sidecar serve`: relay gRPC (and REST) traffic to the backend and export metrics."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from sidecar.config import (
    CONFIG_KEYS,
    GENERAL,
    SAMPLING,
    ConfigError,
    default_text,
    env_name,
    flag_name,
    load_serve_config,
    settings,
)

NAME = "serve"
HELP = (
    "relay gRPC traffic (and, with --http-listen and --http-backend, REST traffic) to Triton / "
    "TF-Serving unchanged, export Prometheus metrics, and profile a sample of live requests "
    "into SQLite traces"
)
SAMPLING_DESCRIPTION = (
    "A sampled request is replayed on a local runtime with leveled profiling (model, layer, "
    "kernel) in a separate low-priority process and stored in SQLite. Sampling is off without "
    "--model-repository. Every setting is also a key of the --config TOML file."
)

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `ServeConfig` setting, from the settings table in sidecar.config.

    Flag defaults are None so that environment and TOML values can fill the gaps (flag > env >
    file > default); the help line states the default once, from the table.
    """
    groups = {GENERAL: parser, SAMPLING: parser.add_argument_group(SAMPLING, SAMPLING_DESCRIPTION)}
    for key, default, setting in settings():
        line = f"{setting.help} (env {env_name(key)}, default {default_text(key)})"
        options: dict[str, Any] = {"help": line.replace("%", "%%")}
        if isinstance(default, bool):
            options.update(action="store_true", default=None)
        elif setting.choices:
            options.update(choices=setting.choices, type=str.lower)
        else:
            options.update(metavar=setting.metavar)
        groups[setting.group].add_argument(flag_name(key), **options)


def run(args: argparse.Namespace) -> int:
    flags = {key: getattr(args, key, None) for key in CONFIG_KEYS}
    try:
        config = load_serve_config(flags)
    except ConfigError as exc:
        print(f"xsp-sidecar serve: error: {exc}", file=sys.stderr)
        return 2
    from sidecar.serve import run_sidecar

    return run_sidecar(config)
