"""Builds the sample Triton model repository used by the demo, the tests and the benchmarks.

Layout is Triton's: `<repo>/<model>/config.pbtxt` and `<repo>/<model>/1/model.py`. The ONNX
model also keeps its `model.onnx` in the version folder, where the profiling worker finds it.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from tests.harness.models import small_cnn_onnx

ADD_SUB_CONFIG = """\
name: "add_sub"
backend: "python"
max_batch_size: 0
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ -1 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

SIMPLE_CNN_CONFIG = """\
name: "simple_cnn"
backend: "python"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 10 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

SLEEP_CONFIG = """\
name: "sleep"
backend: "python"
max_batch_size: 0
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "DELAY_MS" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
"""

# A decoupled model (token streaming): COUNT responses per request, FIRST_MS then SLEEP_MS apart.
TOKEN_STREAM_CONFIG = """\
name: "token_stream"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "FIRST_MS" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "SLEEP_MS" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# A BLS model: a Python step that calls `simple_cnn` (ONNX Runtime) from its model.py.
BLS_CNN_CONFIG = """\
name: "bls_cnn"
backend: "python"
max_batch_size: 0
input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ -1, 3, 32, 32 ] } ]
output [ { name: "PROBS" data_type: TYPE_FP32 dims: [ -1, 10 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# `simple_cnn` run by its model.py: the ONNX file is not `model.onnx`, so the repository
# lookup resolves the model.py (ONNX Runtime inside a Python model).
PY_CNN_CONFIG = SIMPLE_CNN_CONFIG.replace('name: "simple_cnn"', 'name: "py_cnn"') + (
    'parameters { key: "onnx_file" value: { string_value: "cnn.onnx" } }\n'
)

SAMPLE_MODELS = ("add_sub", "simple_cnn", "sleep", "pre", "ens_cnn")  # ens_cnn: pre -> simple_cnn
TEMPLATES = Path(__file__).resolve().parent / "models"  # the Python backend's model.py files


def simple_cnn(seed: int = 0) -> onnx.ModelProto:
    """The `simple_cnn` sample model: the project's small CNN without its Softmax, input
    `input` [N, 3, 32, 32] -> logits `output` [N, 10]."""
    return small_cnn_onnx(seed, softmax=False, output="output", name="simple_cnn")


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def write_config(repo: Path, name: str, config: str) -> Path:
    """Write (or overwrite) model `name`'s `config.pbtxt` in `repo`; returns its path."""
    path = repo / name / "config.pbtxt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config)
    return path


def write_model(repo: Path, name: str, config: str, model_py: str | None = None) -> Path:
    """Write model `name` into `repo`: its `config.pbtxt` and version folder `1`, with the
    Python backend's `model.py` where given; returns the version folder (for a model file)."""
    version_dir = repo / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    write_config(repo, name, config)
    if model_py is not None:
        (version_dir / "model.py").write_text(model_py)
    return version_dir


def build_model_repository(repo: Path) -> Path:
    """Write the sample models (`add_sub`, `simple_cnn`, `sleep`, and the ensemble `ens_cnn`
    with its Python step `pre`: `ensemble_models`) into `repo` and return it."""
    from tests.harness.triton.ensemble_models import add_ensemble  # it writes with write_model

    repo.mkdir(parents=True, exist_ok=True)
    write_model(repo, "add_sub", ADD_SUB_CONFIG, _template("add_sub.py.tmpl"))
    cnn_dir = write_model(repo, "simple_cnn", SIMPLE_CNN_CONFIG, _template("onnx_runner.py.tmpl"))
    onnx.save(simple_cnn(), str(cnn_dir / "model.onnx"))
    write_model(repo, "sleep", SLEEP_CONFIG, _template("sleep.py.tmpl"))
    return add_ensemble(repo)


def add_token_stream(repo: Path) -> Path:
    """Add the decoupled `token_stream` model (`models/token_stream.py.tmpl`) to `repo`."""
    write_model(repo, "token_stream", TOKEN_STREAM_CONFIG, _template("token_stream.py.tmpl"))
    return repo


def add_async_bls(repo: Path) -> Path:
    """Add `async_bls` (`models/async_bls.py.tmpl`: `async def execute`, two `add_sub` calls
    awaited together)."""
    config = ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "async_bls"')
    write_model(repo, "async_bls", config, _template("async_bls.py.tmpl"))
    return repo


def add_py_cnn(repo: Path) -> Path:
    """Add `py_cnn`: `simple_cnn`'s network as `cnn.onnx`, run by `models/onnx_runner.py.tmpl`
    in its model.py (ONNX Runtime inside a Python-backend model)."""
    version_dir = write_model(repo, "py_cnn", PY_CNN_CONFIG, _template("onnx_runner.py.tmpl"))
    onnx.save(simple_cnn(), str(version_dir / "cnn.onnx"))
    return repo


def add_bls_cnn(repo: Path) -> Path:
    """Add the BLS model `bls_cnn` (`models/bls_cnn.py.tmpl`, calling `simple_cnn`) to `repo`."""
    write_model(repo, "bls_cnn", BLS_CNN_CONFIG, _template("bls_cnn.py.tmpl"))
    return repo
