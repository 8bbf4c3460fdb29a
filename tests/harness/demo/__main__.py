"""The demo's command line: `python -m tests.harness.demo [--backend tfserving] [...]` (what
`bash scripts/demo.sh` runs): the whole product on this machine, start to finish."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
PROG = "python -m tests.harness.demo"
DESCRIPTION = (
    "Run a local Triton (or the TF-Serving stand-in) with sample models, put the sidecar in "
    "front, send traffic, profile sampled requests and print a report (results stay in --out). "
    "`bash scripts/demo.sh [OPTIONS]` sets up the environment and runs this."
)
BACKENDS = ("triton", "tfserving")
DEFAULT_FORCED = {"triton": "simple_cnn,ens_cnn", "tfserving": "keras_cnn,keras_transformer"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    parser.add_argument(
        "--backend",
        default="triton",
        choices=BACKENDS,
        help="triton: a real Triton server with OpenTelemetry tracing; tfserving: the stand-in "
        "for tensorflow_model_server (real TensorFlow, Keras models keras_cnn and "
        "keras_transformer, its ProfilerService captured for the server's side) "
        "(default: triton)",
    )
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
        "--rest-requests",
        type=int,
        default=100,
        help="REST requests to send through the sidecar's HTTP plane beside the gRPC ones "
        "(with triton: tritonclient.http with binary tensors, every fifth KServe v2 JSON with "
        "curl); 0: gRPC only (default: 100)",
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
        default=None,
        help="comma-separated models the forced requests go to in turn: with triton, of "
        "simple_cnn,add_sub,ens_cnn (add_sub is profiled by running its own model.py; the "
        "ensemble ens_cnn as its steps, pre then simple_cnn; default: simple_cnn,ens_cnn); "
        "with tfserving, of keras_cnn,keras_transformer "
        "(default: both)",
    )
    parser.add_argument(
        "--format",
        default="text",
        choices=["text", "markdown"],
        help="format of the report printed at the end (default: text)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging verbosity of the demo itself (default: INFO)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from tests.harness.demo import triton
    from tests.harness.demo.failures import explain

    forceable, run_demo = triton.FORCEABLE, triton.run_demo
    if args.backend == "tfserving":
        from tests.harness.demo import tfserving

        forceable, run_demo = tfserving.FORCEABLE, tfserving.run_tfserving_demo

    if args.requests < 1:
        raise SystemExit("error: --requests must be at least 1")
    if args.rest_requests < 0:
        raise SystemExit("error: --rest-requests must be 0 or more")
    given = args.forced_models if args.forced_models is not None else DEFAULT_FORCED[args.backend]
    forced_models = tuple(m.strip() for m in given.split(",") if m.strip())
    unknown = sorted(set(forced_models) - set(forceable))
    if unknown or not forced_models:
        raise SystemExit(
            f"error: --forced-models takes {', '.join(forceable)} with --backend "
            f"{args.backend}; got {given!r}"
        )
    options = triton.DemoOptions(
        out=args.out,
        requests=args.requests,
        sample_rate=args.sample_rate,
        forced=args.forced,
        forced_models=forced_models,
        report_format=args.format,
        rest_requests=args.rest_requests,
    )
    try:
        return run_demo(options)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        log.debug("the demo failed", exc_info=True)
        known = explain(exc)
        line = known or (
            f"the demo failed: {type(exc).__name__}: {exc}".splitlines()[0]
            + " (run it again with --log-level DEBUG for the traceback)"
        )
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
