"""Model lookup in Triton model repositories (the real sample repository and small ones) and in
TF-Serving model base paths (real Keras SavedModels)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sidecar.backends.model_repository import (
    ModelConfigError,
    ModelNotFoundError,
    ModelVersionNotFoundError,
    TensorSpec,
    UnsupportedModelFormatError,
    datatype_name,
    find_model,
    model_in_repository,
    python_models,
)
from sidecar.profiling.formats import ModelFormat
from tests.harness.triton.model_repo import build_model_repository


@pytest.fixture(scope="module")
def sample_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_repository(tmp_path_factory.mktemp("repo") / "models")


def make_model(repo: Path, name: str, config: str | None, files: dict[str, str]) -> Path:
    model_dir = repo / name
    model_dir.mkdir(parents=True)
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    for relative, text in files.items():
        path = model_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if relative.endswith("/"):
            path.mkdir(exist_ok=True)
        else:
            path.write_text(text)
    return model_dir


def test_python_backend_with_onnx_file_counts_as_onnx(sample_repo: Path) -> None:
    found = find_model(sample_repo, "simple_cnn")
    assert found.format is ModelFormat.ONNX
    assert found.path == sample_repo / "simple_cnn" / "1" / "model.onnx"
    assert (found.version, found.backend, found.platform) == ("1", "python", "")
    assert found.max_batch_size == 8
    assert found.inputs == (TensorSpec("input", "FP32", (3, 32, 32)),)
    assert found.outputs == (TensorSpec("output", "FP32", (10,)),)
    assert found.config is not None and found.config.name == "simple_cnn"


def test_python_model_with_only_its_model_py_resolves_to_it(sample_repo: Path) -> None:
    found = find_model(sample_repo, "add_sub")
    assert found.format is ModelFormat.PYTHON
    assert found.path == sample_repo / "add_sub" / "1" / "model.py"
    assert found.config is not None and found.config.backend == "python"


def test_python_model_is_unsupported_when_python_replay_is_off(sample_repo: Path) -> None:
    with pytest.raises(
        UnsupportedModelFormatError, match=r"add_sub.*--replay-python-models is off"
    ):
        python_models(find_model, False)(sample_repo, "add_sub")
    assert python_models(find_model, False)(sample_repo, "simple_cnn").format is ModelFormat.ONNX
    assert python_models(find_model, True) is find_model


def test_unknown_model_lists_known_ones(sample_repo: Path) -> None:
    with pytest.raises(
        ModelNotFoundError, match=r"'resnet'.*add_sub, ens_cnn, pre, simple_cnn, sleep"
    ):
        find_model(sample_repo, "resnet")
    with pytest.raises(ModelNotFoundError, match="not a valid model name"):
        find_model(sample_repo, "../etc")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        find_model(sample_repo / "missing", "simple_cnn")


def test_latest_numeric_version_and_explicit_version(tmp_path: Path) -> None:
    config = 'name: "m"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
    files = {f"{v}/model.onnx": "x" for v in ("1", "2", "10")}
    make_model(tmp_path, "m", config, {**files, "notes/": ""})
    assert find_model(tmp_path, "m").version == "10"  # numeric, not lexicographic
    assert find_model(tmp_path, "m", "2").path == tmp_path / "m" / "2" / "model.onnx"
    assert find_model(tmp_path, "m", 1).version == "1"
    assert find_model(tmp_path, "m", "").version == "10"
    with pytest.raises(ModelVersionNotFoundError, match=r"no version '3'.*1, 2, 10"):
        find_model(tmp_path, "m", "3")


def test_version_policy_specific_is_honoured(tmp_path: Path) -> None:
    config = 'backend: "onnxruntime"\nversion_policy: { specific: { versions: [ 1 ] } }\n'
    make_model(tmp_path, "m", config, {"1/model.onnx": "x", "2/model.onnx": "x"})
    assert find_model(tmp_path, "m").version == "1"


def test_no_version_folder(tmp_path: Path) -> None:
    make_model(tmp_path, "m", 'backend: "onnxruntime"\n', {})
    with pytest.raises(ModelVersionNotFoundError, match="no numeric version folder"):
        find_model(tmp_path, "m")


def test_formats_by_platform_default_filename_and_without_config(tmp_path: Path) -> None:
    make_model(tmp_path, "torch", 'platform: "pytorch_libtorch"\n', {"1/model.pt": "x"})
    assert find_model(tmp_path, "torch").format is ModelFormat.TORCHSCRIPT
    make_model(tmp_path, "tf", 'platform: "tensorflow_savedmodel"\n', {"1/model.savedmodel/": ""})
    found = find_model(tmp_path, "tf")
    assert found.format is ModelFormat.SAVEDMODEL and found.path.is_dir()
    make_model(
        tmp_path,
        "custom",
        'backend: "onnxruntime"\ndefault_model_filename: "net.onnx"\n',
        {"1/net.onnx": "x", "1/model.onnx": "x"},
    )
    assert find_model(tmp_path, "custom").path.name == "net.onnx"
    make_model(tmp_path, "bare", None, {"1/model.pt": "x"})
    bare = find_model(tmp_path, "bare")
    assert (bare.format, bare.config, bare.inputs) == (ModelFormat.TORCHSCRIPT, None, ())


def test_unsupported_formats(tmp_path: Path) -> None:
    make_model(tmp_path, "trt", 'platform: "tensorrt_plan"\n', {"1/model.plan": "x"})
    with pytest.raises(UnsupportedModelFormatError, match="TensorRT"):
        find_model(tmp_path, "trt")
    make_model(tmp_path, "onnx", 'platform: "onnxruntime_onnx"\n', {"1/model.pt": "x"})
    with pytest.raises(UnsupportedModelFormatError, match=r"no model\.onnx.*found: model\.pt"):
        find_model(tmp_path, "onnx")
    make_model(
        tmp_path,
        "named",
        'backend: "python"\ndefault_model_filename: "weights.bin"\n',
        {"1/weights.bin": "x"},
    )
    with pytest.raises(UnsupportedModelFormatError, match=r"format of weights\.bin"):
        find_model(tmp_path, "named")
    make_model(
        tmp_path, "gone", 'backend: "onnxruntime"\ndefault_model_filename: "a.onnx"\n', {"1/": ""}
    )
    with pytest.raises(UnsupportedModelFormatError, match=r"'a\.onnx' is not in"):
        find_model(tmp_path, "gone")


def test_malformed_and_mismatched_config(tmp_path: Path) -> None:
    make_model(tmp_path, "bad", "name: [unclosed\n", {"1/model.onnx": "x"})
    with pytest.raises(ModelConfigError, match=r"config\.pbtxt is not a valid Triton model"):
        find_model(tmp_path, "bad")
    make_model(tmp_path, "typo", "max_batch: 4\n", {"1/model.onnx": "x"})
    with pytest.raises(ModelConfigError, match="max_batch"):
        find_model(tmp_path, "typo")
    make_model(tmp_path, "renamed", 'name: "other"\n', {"1/model.onnx": "x"})
    with pytest.raises(ModelConfigError, match="'other' but its folder is 'renamed'"):
        find_model(tmp_path, "renamed")


def test_datatype_names() -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    assert datatype_name(mc.TYPE_FP32) == "FP32"
    assert datatype_name(mc.TYPE_STRING) == "BYTES"
    assert datatype_name(mc.TYPE_BF16) == "BF16"


def test_model_in_repository_accepts_only_model_folders(tmp_path: Path) -> None:
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    repo = tmp_path / "repo"
    assert model_in_repository(repo, "m")
    for name in ("", ".", "..", "../outside", "nope", "m\0", "a/b", "x" * 10_000):
        assert not model_in_repository(repo, name), name
    with pytest.raises(ModelNotFoundError, match="not a valid model name"):
        find_model(repo, "m\0")


def test_tf_serving_layout_resolves_the_version_folder_as_a_savedmodel(
    tf_model_base: Path, tmp_path: Path
) -> None:
    found = find_model(tf_model_base, "keras_cnn")
    assert (found.format, found.version, found.path) == (
        ModelFormat.SAVEDMODEL, "1", tf_model_base / "keras_cnn" / "1",
    )  # fmt: skip
    assert (found.config, found.inputs, found.max_batch_size) == (None, (), 0)
    assert find_model(tf_model_base, "keras_transformer").format is ModelFormat.SAVEDMODEL

    base = tmp_path / "models"
    shutil.copytree(tf_model_base / "keras_cnn", base / "keras_cnn")
    shutil.copytree(base / "keras_cnn" / "1", base / "keras_cnn" / "10")
    (base / "keras_cnn" / "2").mkdir()  # a version TF-Serving cannot load either
    assert find_model(base, "keras_cnn").path == base / "keras_cnn" / "10"  # numeric, not text
    assert find_model(base, "keras_cnn", "1").path == base / "keras_cnn" / "1"
    with pytest.raises(UnsupportedModelFormatError, match=r"saved_model\.pb.*found: nothing"):
        find_model(base, "keras_cnn", 2)
    with pytest.raises(ModelVersionNotFoundError, match=r"no version '3'.*versions: 1, 2, 10"):
        find_model(base, "keras_cnn", "3")
    with pytest.raises(ModelNotFoundError, match=r"'keras_rnn'.*found: keras_cnn\)"):
        find_model(base, "keras_rnn")
    (base / "saved_model.pb").write_bytes(b"")  # a file, not a model folder
    with pytest.raises(ModelNotFoundError, match=r"'saved_model\.pb' is not in the model"):
        find_model(base, "saved_model.pb")
