"""The installed product carries no test harness: the wheel built from this checkout (what the
image's `pip install .` installs) lists the runtime's files and none of `tests/harness/` (local
servers, test models, synthetic traces, the demo), even when `tests/` sits beside the sources,
and, built where a C compiler exists, the relay's three C extensions.

The wheel is built offline with this environment's setuptools (`pip wheel --no-build-isolation
--no-index`) from a scratch copy, so the checkout gets no `build/` or `*.egg-info`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from sidecar.proxy import native, native_check
from tests.harness import REPO_ROOT

pytestmark = pytest.mark.slow

JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")
# modules that lived in the runtime package before they moved to tests/harness/
MOVED = (
    "sidecar/localtriton/",
    "sidecar/localtfserving/",
    "sidecar/demo.py",
    "sidecar/demo_tfserving.py",
    "sidecar/commands/demo.py",
    "sidecar/metrics_text.py",
    "sidecar/profiling/testmodels.py",
    "sidecar/trace/synthetic.py",
    "sidecar/trace/memory.py",
    "sidecar/trace/report_scenarios.py",
)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    for name in ("sidecar", "analysis", "tests/harness"):
        shutil.copytree(REPO_ROOT / name, src / name, ignore=JUNK)
    shutil.copy2(REPO_ROOT / "tests" / "__init__.py", src / "tests" / "__init__.py")
    dist = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--disable-pip-version-check", "-w", str(dist)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    [wheel] = dist.glob("xsp_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_holds_the_runtime(wheel_files: list[str]) -> None:
    runtime = ("sidecar/cli.py", "sidecar/serve.py", "sidecar/commands/serve.py",
               "sidecar/proxy/relay.py", "analysis/report.py", "analysis/tuning.py",
               "analysis/load/tracedb.py", "analysis/relations/kernel_rows.py",
               "analysis/analyses/common.py", "analysis/render/text.py",
               "analysis/fleet/export.py")  # fmt: skip
    assert [name for name in runtime if name not in wheel_files] == []


def test_the_wheel_carries_no_test_harness(wheel_files: list[str]) -> None:
    packages = {name.split("/")[0] for name in wheel_files if not name.startswith("xsp_sidecar-")}
    assert packages == {"sidecar", "analysis"}
    assert [n for n in wheel_files if n.startswith(MOVED) or n.endswith(".py.tmpl")] == []


@pytest.mark.skipif(native_check.compiler() is None, reason="no C compiler: a pure-Python wheel")
def test_the_wheel_holds_the_relays_c_extensions(wheel_files: list[str]) -> None:
    """Built where a compiler exists, the wheel carries all three (`setup.py` keeps them
    optional so that an install without one still works)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    wanted = [f"sidecar/proxy/{name}{suffix}" for name in native.EXTENSIONS]
    assert [name for name in wanted if name not in wheel_files] == []
