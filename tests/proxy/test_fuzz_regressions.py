"""The fuzz targets' checks (tests/fuzz/fuzz_*.py: a C parser of the relay against its Python
reference) on every input of their seed corpora (tests/fuzz/corpus/<target>/, made from real
gRPC exchanges by tests/fuzz/corpus_build.py) and on every input a fuzzer found a difference or
a crash with (tests/fuzz/regressions/<target>/, each named after what it found).

A new finding: copy the reproducer scripts/fuzz.sh printed to tests/fuzz/regressions/<target>/
with a name that says what went wrong, fix the C, and this test keeps it fixed.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from sidecar.proxy import frames, relay, stream_messages, streams
from tests.fuzz.common import CORPUS

pytestmark = pytest.mark.skipif(
    frames.native_walk is None
    or streams._NativeStream is None
    or relay.native_pump is None
    or stream_messages.native_readers is None,
    reason="the relay's C extensions are not built here",
)

TARGETS = ["framewalk", "pump", "messagewalk", "model_name", "hpack", "httppump"]
REGRESSIONS = Path(__file__).parents[1] / "fuzz" / "regressions"


def inputs(folder: Path) -> list[tuple[str, Path]]:
    return [
        (target, path)
        for target in TARGETS
        if (folder / target).is_dir()
        for path in sorted((folder / target).iterdir())
        if path.is_file()
    ]


def test_every_target_has_a_seed_corpus() -> None:
    assert all(any((CORPUS / target).iterdir()) for target in TARGETS)


@pytest.mark.parametrize(
    ("target", "path"), inputs(CORPUS) + inputs(REGRESSIONS), ids=lambda v: getattr(v, "name", v)
)
def test_c_and_python_agree(target: str, path: Path) -> None:
    check = importlib.import_module(f"tests.fuzz.fuzz_{target}").check
    check(path.read_bytes())
