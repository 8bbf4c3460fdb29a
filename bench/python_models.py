"""Python-backend models replayed by their own `model.py` (issue 40, item 2): what level L
costs, and how the replay's M compares with Triton's own compute time.

- offline: the leveled experiment of each harness model (`add_sub`, the BLS model `bls_cnn`
  calling the ONNX `simple_cnn`, `simple_cnn`'s own model.py running ONNX Runtime inside) with
  `--iterations` timed runs per level: M (trimmed mean of `execute`), L (the same with
  `sys.setprofile` recording the model's Python calls), L/M, and the spans L recorded;
- live (`--live N`): the real Triton 2.51 in OpenTelemetry mode behind the real
  `xsp-sidecar serve`, N forced requests per model; per model the p50 of the replay's M /
  Triton's `compute_infer` (trace attribute `fidelity`) and of each side alone;
- ensemble (`--ensemble N`): N forced requests to the sample ensemble `ens_cnn` (`pre`, then
  `simple_cnn`) the same way, replayed as its steps; per step the p50 of the step's replay
  (its M) / that step's live `compute_infer`, as the report's fidelity analysis computes it
  (`analysis.analyses.ensemble_steps.step_fidelity`).

    python bench/python_models.py [--iterations 50] [--warmup 5] [--live 10] [--ensemble 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.harness

import numpy as np
import tritonclient.grpc as grpcclient

from analysis.analyses.common import Frames
from analysis.analyses.ensemble_steps import step_fidelity
from analysis.load.trace_filter import TraceFilter
from analysis.load.tracedb import load_traces
from sidecar.backends.model_repository import find_model
from sidecar.profiling.experiment import run_experiment
from sidecar.profiling.runners.select import runner_for
from sidecar.trace.spans import Level
from sidecar.trace.store import TraceStore
from tests.harness.process import free_port
from tests.harness.sidecar_process import SidecarProcess
from tests.harness.triton.model_repo import add_bls_cnn, build_model_repository
from tests.harness.triton.tracing import traced_server

RNG = np.random.default_rng(0)
INPUTS = {
    "add_sub": {
        "INPUT0": np.arange(16, dtype=np.float32),
        "INPUT1": np.ones(16, dtype=np.float32),
    },
    "bls_cnn": {"IMAGE": RNG.random((1, 3, 32, 32), np.float32) * 255},
    "simple_cnn": {"input": RNG.random((1, 3, 32, 32), np.float32)},
    "ens_cnn": {"RAW": RNG.random((1, 3, 32, 32), np.float32) * 255},
}


def offline(repo: Path, iterations: int, warmup: int) -> None:
    print(f"offline, {iterations} timed runs per level after {warmup} warm-up")
    print(
        f"{'model.py of':<12} {'M us':>9} {'L us':>9} {'L/M':>6} {'K us':>9} {'K/M':>6}  "
        "K spans (ONNX Runtime nodes below a call)  L spans per execute"
    )
    for model, inputs in INPUTS.items():
        if model == "ens_cnn":
            continue  # an ensemble: `--ensemble`
        runner = runner_for(repo / model / "1" / "model.py", find=find_model)
        profile = run_experiment(runner, inputs, model=model, iterations=iterations, warmup=warmup)
        m = profile.stats(Level.MODEL).trimmed_mean_ns / 1e3
        layer = profile.stats(Level.LAYER)
        names = sorted({s.name for s in profile.spans_at(Level.LAYER)})
        count = len(profile.spans_at(Level.LAYER))
        kernel = profile.stats(Level.KERNEL)
        nodes = len(profile.spans_at(Level.KERNEL))
        print(
            f"{model:<12} {m:9.1f} {layer.trimmed_mean_ns / 1e3:9.1f} "
            f"{layer.overhead_ratio:6.2f} {kernel.trimmed_mean_ns / 1e3:9.1f} "
            f"{kernel.overhead_ratio:6.2f}  {nodes:>5}  {count}: {', '.join(names)}"
        )


def forced(repo: Path, requests: int, tmp: Path, models: tuple[str, ...]) -> tuple[Path, str]:
    """`requests` forced requests per model through the sidecar in front of a traced Triton;
    the trace database and a line of the profiles' outcomes."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/traces"
    tmp.mkdir(parents=True, exist_ok=True)
    db = tmp / "traces.db"
    args = ["--model-repository", str(repo), "--db", str(db), "--otlp-port", str(port),
            "--sample-rate", "0", "--duty-cycle", "1", "--sample-budget", "1000",
            "--queue-size", "64", "--iterations", "10", "--warmup", "2"]  # fmt: skip
    with traced_server(repo, tmp / "tritonserver.log", url, 100) as triton:
        proc = SidecarProcess(backend=triton.grpc_address, log_path=tmp / "sidecar.log", args=args)
        with proc:
            client = grpcclient.InferenceServerClient(proc.address)
            for _ in range(requests):
                for model in models:
                    tensors = []
                    for name, x in INPUTS[model].items():
                        tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
                        tensor.set_data_from_numpy(x)
                        tensors.append(tensor)
                    client.infer(model, tensors, headers={"x-xsp-profile": "1"})
                    time.sleep(0.05)
            deadline = time.monotonic() + 300
            want = requests * len(models)
            while proc.metric("xsp_profiles_total") < want and time.monotonic() < deadline:
                time.sleep(1)
            time.sleep(3)  # the last backend spans
            ok = proc.metric("xsp_profiles_total", outcome="ok")
            errors = proc.metric("xsp_profiles_total", outcome="error")
    return db, f"profiles ok {ok:g}, error {errors:g}"


def live(repo: Path, requests: int, tmp: Path) -> None:
    models = ("add_sub", "bls_cnn", "simple_cnn")
    db, outcomes = forced(repo, requests, tmp / "live", models)
    store = TraceStore(db)
    print(f"\nlive: {requests} forced requests per model; {outcomes}")
    print(f"{'model':<12} {'n':>3} {'replay M us':>12} {'compute_infer us':>17} {'ratio p50':>10}")
    for model in models:
        found = [t.attributes.get("fidelity") or {} for t in store.list_traces(model=model)]
        pairs = [f for f in found if f.get("ratio") is not None]
        if not pairs:
            print(f"{model:<12} no trace with Triton's compute_infer")
            continue
        replay = statistics.median(f["replay_model_ns"] for f in pairs) / 1e3
        server = statistics.median(f["live_compute_ns"] for f in pairs) / 1e3
        ratio = statistics.median(f["ratio"] for f in pairs)
        print(f"{model:<12} {len(pairs):3d} {replay:12.1f} {server:17.1f} {ratio:10.3f}")
    store.close()


def ensemble(repo: Path, requests: int, tmp: Path) -> None:
    db, outcomes = forced(repo, requests, tmp / "ensemble", ("ens_cnn",))
    per_step = step_fidelity(Frames(load_traces([db], TraceFilter())))
    print(f"\nensemble: {requests} forced requests to ens_cnn; {outcomes}")
    print(f"{'step':<20} {'n':>3} {'replay M us':>12} {'compute_infer us':>17} {'ratio p50':>10}")
    for r in per_step.itertuples(index=False):
        print(
            f"{r.key:<20} {r.requests:3d} {r.replay_p50_ms * 1e3:12.1f} "
            f"{r.live_p50_ms * 1e3:17.1f} {r.ratio_p50:10.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--live", type=int, default=0, help="forced requests per model")
    parser.add_argument("--ensemble", type=int, default=0, help="forced requests to ens_cnn")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xsp-pymodels-") as tmp:
        repo = add_bls_cnn(build_model_repository(Path(tmp) / "models"))
        offline(repo, args.iterations, args.warmup)
        if args.live:
            live(repo, args.live, Path(tmp))
        if args.ensemble:
            ensemble(repo, args.ensemble, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
