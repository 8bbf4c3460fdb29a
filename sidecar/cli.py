"""The `xsp-sidecar` command line: one subcommand per module under `sidecar.commands`.

Each command module exposes `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from sidecar import __version__

EPILOG = """\
reports:
  `serve --db FILE` and `profile --db FILE` write traces to a SQLite store; analyse it with
    python analysis/report.py FILE [--format text|markdown|html|json|csv] [--model NAME]
  (findings with suggested actions first, then XSP's analyses A1-A15; see its --help).

Run 'xsp-sidecar COMMAND --help' for a command's options and defaults.
"""

COMMAND_MODULES = (
    "sidecar.commands.serve",
    "sidecar.commands.profile",
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = argparse.ArgumentParser(
        prog="xsp-sidecar",
        description=(
            "Forward gRPC inference traffic to Triton / TF-Serving untouched, export Prometheus "
            "metrics, and turn sampled requests into leveled (model -> layer -> kernel) profiles."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"xsp-sidecar {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules: dict[str, object] = {}
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # command not built yet
                continue
            raise
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        modules[module.NAME] = module
    return parser, modules


def main(argv: Sequence[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command is None:
        parser.print_help()
        return 2
    module = modules[args.command]
    return int(module.run(args))  # type: ignore[attr-defined]


if __name__ == "__main__":
    raise SystemExit(main())
