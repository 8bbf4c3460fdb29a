"""`xsp-sidecar profile` of a model in a Triton repository: its config.pbtxt sets the session
and the default batch sweep, and every trace records both (real ONNX Runtime, real SQLite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.cli import main
from sidecar.trace.store import TraceStore

FAST = ["--iterations", "3", "--warmup", "1", "--no-peak", "--levels", "M", "--max-rounds", "0"]
CONFIG = """\
name: "cnn"
backend: "onnxruntime"
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 4, 2 ] }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


@pytest.fixture()
def model(cnn_onnx: Path, tmp_path: Path) -> Path:
    """`<repo>/cnn/1/model.onnx` beside `<repo>/cnn/config.pbtxt`."""
    version = tmp_path / "repo" / "cnn" / "1"
    version.mkdir(parents=True)
    (version.parent / "config.pbtxt").write_text(CONFIG)
    path = version / "model.onnx"
    path.write_bytes(cnn_onnx.read_bytes())
    return path


def settings_of(db: Path) -> list[tuple[int, dict[str, dict[str, object]], dict[str, object]]]:
    with TraceStore(db) as store:
        return sorted(
            (
                t.batch_size or 0,
                {r["setting"]: r for r in t.attributes["replay_settings"]},
                t.attributes["server_config"],
            )
            for t in store.list_traces()
        )


def test_the_default_sweep_is_1_the_preferred_sizes_and_max_batch_size(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "traces.db"
    assert main(["profile", str(model), "--db", str(db), *FAST]) == 0
    assert "batch sizes from config.pbtxt: 1, 2, 4, 8" in capsys.readouterr().err
    traces = settings_of(db)
    assert [batch for batch, _, _ in traces] == [1, 2, 4, 8]
    for _, records, server in traces:
        assert records["max_batch_size"]["applied"] is True
        assert records["dynamic_batching.preferred_batch_size"]["value"] == "4,2"
        assert records["parameters.intra_op_thread_count"]["applied"] is True
        assert server["preferred_batch_sizes"] == [4, 2] and server["max_batch_size"] == 8


def test_given_batch_sizes_win_and_the_record_says_so(model: Path, tmp_path: Path) -> None:
    db = tmp_path / "traces.db"
    assert main(["profile", str(model), "--db", str(db), "--batch-size", "3", *FAST]) == 0
    ((batch, records, _),) = settings_of(db)
    assert batch == 3
    assert records["max_batch_size"]["applied"] is False
    assert records["max_batch_size"]["reason"] == "--batch-size given"


def test_a_config_that_does_not_parse_is_a_one_line_error(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (model.parent.parent / "config.pbtxt").write_text("max_batch_size: eight\n")
    assert main(["profile", str(model), *FAST]) == 2
    err = capsys.readouterr().err
    assert "config.pbtxt is not a valid Triton model config" in err
    assert len(err.strip().splitlines()) == 1


def test_help_names_the_default_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    assert "preferred_batch_size" in " ".join(capsys.readouterr().out.split())
