"""`xsp-sidecar demo`: the whole product on this machine, start to finish."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "demo"
HELP = (
    "run a local Triton with sample models, put the sidecar in front, send traffic, profile "
    "sampled requests and print a report (results stay in --out)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo-out"),
        help="folder for the trace database, report and logs (default: demo-out)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=300,
        help="requests to send through the sidecar (default: 300)",
    )
    parser.add_argument(
        "--sample-rate",
        type=float,
        default=0.02,
        help="probability a request is profiled (default: 0.02)",
    )
    parser.add_argument(
        "--forced", type=int, default=3, help="requests sent with x-xsp-profile: 1 (default: 3)"
    )
    parser.add_argument(
        "--forced-models",
        default="simple_cnn",
        help="comma-separated models the forced requests go to in turn, of "
        "simple_cnn,add_sub; add_sub has no ONNX file, so its profiles fail and the console "
        "says why (default: simple_cnn)",
    )
    parser.add_argument(
        "--format",
        default="text",
        choices=["text", "markdown"],
        help="format of the report printed at the end (default: text)",
    )


def run(args: argparse.Namespace) -> int:
    from sidecar.demo import FORCEABLE, DemoOptions, run_demo

    if args.requests < 1:
        raise SystemExit("error: --requests must be at least 1")
    forced_models = tuple(m.strip() for m in args.forced_models.split(",") if m.strip())
    unknown = sorted(set(forced_models) - set(FORCEABLE))
    if unknown or not forced_models:
        raise SystemExit(
            f"error: --forced-models takes {', '.join(FORCEABLE)}; got {args.forced_models!r}"
        )
    return run_demo(
        DemoOptions(
            out=args.out,
            requests=args.requests,
            sample_rate=args.sample_rate,
            forced=args.forced,
            forced_models=forced_models,
            report_format=args.format,
        )
    )
