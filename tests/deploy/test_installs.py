"""Every install a user is told about resolves in a fresh virtualenv, with real pip.

The install lines are read from the places users read them (README.md, docs/deploy.md, the
Dockerfile's header and build arguments, the Helm chart's notes and values), so a line added
there is tested and a documented combination that stops resolving fails here:

- each documented set of extras (`pip install 'xsp-sidecar[...]'`, `pip install .`,
  `docker build --build-arg EXTRAS=[...]`, with `VARIANT=gpu` or not) is resolved the way the
  Dockerfile's build stage installs it: the stage's own `pip` commands, parsed from the
  Dockerfile, run with `--dry-run --ignore-installed --report` in a fresh venv whose pip was
  upgraded as the docs and the Dockerfile say (no container engine runs here);
- `.[tensorflow]` is installed for real into a fresh venv, whose `xsp-sidecar profile` then
  profiles a Keras SavedModel built there (`tests/harness/tfserving/models.py`) and must give
  layer spans with the Keras layer names;
- the plain runtime install gets an extra added afterwards (`pip install '.[tensorflow]'` into
  an environment that already has `xsp-sidecar`), resolved against what is installed.

The project itself enters as a wheel built once per session from this checkout (the same
metadata `pip install .` reads; building it once saves a build environment per resolution).
PyTorch: on a CPU-only machine the docs point pip at PyTorch's CPU index; that index is not
reachable from CI, so a CPU `[pytorch]` resolution pins the CPU build the dev setup installs
(`TORCH_CPU`) instead. The GPU image takes PyPI's CUDA build on purpose: its resolution reads
that build's metadata (and its NVIDIA libraries' against cupti-python's), downloading no wheel.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.test_dockerfile import Stage, expand, parse

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = (
    "README.md",
    "docs/deploy.md",
    "Dockerfile",
    "helm/xsp-sidecar/templates/NOTES.txt",
    "helm/xsp-sidecar/values.yaml",
    "helm/xsp-sidecar/values-tfserving.yaml",
)
# The combinations users are told about; each must be documented somewhere above.
REQUIRED = {
    ("cpu", ()),
    ("cpu", ("pytorch",)),
    ("cpu", ("tensorflow",)),
    ("cpu", ("analysis",)),
    ("cpu", ("analysis", "tensorflow")),
    ("cpu", ("analysis", "pytorch")),
    ("gpu", ()),
}
SETUP = (REPO / "scripts" / "setup.sh").read_text()
# The CPU build of PyTorch the dev setup pins (scripts/setup.sh), standing in for PyTorch's CPU
# index, which CI cannot reach.
TORCH_CPU = re.findall(r"torch==[\w.+]+", SETUP)[-1]
# Keras layer names of the test CNN (tests/harness/tfserving/models.py)
CNN_LAYERS = {"conv1", "pool1", "conv2", "gap", "fc"}
# Dry runs at once: pip mostly waits on the index (about 5 s of CPU in a 20-40 s resolution).
RESOLVERS = 4
QUIET = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


# -- what the documents tell users to install -------------------------------------------
@dataclass(frozen=True, order=True)
class Install:
    variant: str  # cpu | gpu: the Dockerfile's build stage the install follows
    extras: tuple[str, ...]  # sorted

    @property
    def id(self) -> str:
        return f"{self.variant}[{','.join(self.extras)}]"


def _extras(text: str) -> tuple[str, ...]:
    return tuple(sorted(e.strip() for e in text.strip("[]").split(",") if e.strip()))


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, line) with backslash continuations joined, as a shell reads them."""
    start, parts = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        start = start or number
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        yield start, " ".join([*parts, line])
        start, parts = 0, []


def documented_installs() -> dict[Install, list[str]]:
    """Every install named in DOCUMENTS -> where it is named (file:line)."""
    found: dict[Install, list[str]] = {}

    def add(install: Install, where: str) -> None:
        found.setdefault(install, []).append(where)

    for name in DOCUMENTS:
        for number, line in logical_lines((REPO / name).read_text()):
            where = f"{name}:{number}"
            for command in re.findall(r"pip install ([^`\n&#|;]+)", line):
                words = [w for w in shlex.split(command, posix=True) if not w.startswith("-")]
                for word in words:
                    m = re.fullmatch(r"(xsp-sidecar|\.)(\[[\w,]+\])?", word)
                    # the dev line: scripts/setup.sh's, checked by its own test below
                    if m and "dev" not in _extras(m.group(2) or ""):
                        add(Install("cpu", _extras(m.group(2) or "")), where)
            for build in re.findall(r"docker build ([^`\n#]+)", line):
                args = dict(re.findall(r"--build-arg (\w+)=(\S+)", build))
                variant = args.get("VARIANT", "cpu")
                add(Install(variant, _extras(args.get("EXTRAS", ""))), where)
            # "extras combine: --build-arg EXTRAS=[tensorflow,analysis]" and the tables
            if "docker build" not in line:
                for extras in re.findall(r"EXTRAS=(\[[\w,]+\])", line):
                    add(Install("cpu", _extras(extras)), where)
    return found


DOCUMENTED = documented_installs()
CASES = sorted(DOCUMENTED)


def test_the_documents_name_every_install_the_project_supports() -> None:
    assert {(i.variant, i.extras) for i in DOCUMENTED} >= REQUIRED, DOCUMENTED
    extras = {e for i in DOCUMENTED for e in i.extras}
    defined = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras <= set(defined) - {"dev"}, f"documented extras not in pyproject: {extras}"


def test_setup_installs_the_documented_dev_line() -> None:
    [line] = [ln.strip() for ln in SETUP.splitlines() if re.match(r"\s*pip install .*-e ", ln)]
    documented = line.replace(" --quiet", "")
    assert documented in (REPO / "README.md").read_text(), documented
    assert "[dev," in documented and TORCH_CPU in documented


# -- the Dockerfile's own install steps ----------------------------------------------------
def build_steps(variant: str) -> list[list[str]]:
    """The `pip install` commands of the variant's build stage, in order, as argument lists
    with the stage's ARG defaults expanded (EXTRAS left as `${EXTRAS}`)."""
    global_args, stages = parse()
    stage: Stage = next(s for s in stages if s.name == f"build-{variant}")
    args = dict(global_args)
    for arg in stage.all("ARG"):
        key, _, default = arg.partition("=")
        if default:
            args[key] = default.strip('"')
    args["EXTRAS"] = "${EXTRAS}"
    steps = []
    for run in stage.all("RUN"):
        for command in run.split("&&"):
            words = shlex.split(expand(command.strip(), args))
            if len(words) > 2 and words[0].endswith("/pip") and words[1] == "install":
                steps.append(words[2:])
    return steps


def test_build_stages_upgrade_pip_then_install_the_package() -> None:
    for variant in ("cpu", "gpu"):
        steps = build_steps(variant)
        assert steps[0] == ["--upgrade", "pip"], steps  # the bundled pip gives up (docs)
        assert steps[1][0] == ".${EXTRAS}", steps


# -- pip in fresh venvs ----------------------------------------------------------------------
def _run(
    argv: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> str:
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env or QUIET, cwd=cwd
    )
    assert run.returncode == 0, f"{shlex.join(argv)}\n{run.stdout[-4000:]}{run.stderr[-4000:]}"
    return run.stdout


def fresh_venv(path: Path) -> Path:
    """`python3.11 -m venv`, then the pip upgrade the docs and the Dockerfile start with."""
    _run([sys.executable, "-m", "venv", str(path)], 120)
    python = path / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], 180)
    return python


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project built from this checkout (C extensions included), once per session."""
    src = tmp_path_factory.mktemp("installs-src")
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("sidecar", "analysis"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    dist = tmp_path_factory.mktemp("installs-dist")
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
          "--no-index", "--quiet", "-w", str(dist)], 300)  # fmt: skip
    [built] = dist.glob("xsp_sidecar-*.whl")
    return built


@pytest.fixture(scope="session")
def resolver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fresh venv for every dry run: `--ignore-installed` resolves as if it were empty."""
    return fresh_venv(tmp_path_factory.mktemp("installs-resolver") / "venv")


def _requirements(step: list[str], wheel: Path, extras: tuple[str, ...]) -> list[str]:
    spec = f"[{','.join(extras)}]" if extras else ""
    return [w.replace(".${EXTRAS}", f"{wheel}{spec}") for w in step]


def resolve(
    python: Path,
    requirements: list[str],
    report: Path,
    *,
    fresh: bool = True,
    pin_torch: bool = True,
) -> dict[str, str]:
    """pip's dry-run resolution of `requirements`: {name: version} it would install."""
    argv = [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report)]
    if fresh:
        argv.append("--ignore-installed")
    env = None
    if any(re.match(r"[^\[]*\[[^\]]*pytorch", r) for r in requirements):
        if pin_torch:
            argv.append(TORCH_CPU)
        else:  # as in an image: no pip configuration, no wheels lying on this machine's disk
            env = {k: v for k, v in QUIET.items() if k != "PIP_FIND_LINKS"}
            env["PIP_CONFIG_FILE"] = os.devnull
    # a resolver that backtracks for minutes fails here, as it would fail a user
    _run([*argv, *requirements], 300, env=env)
    doc = json.loads(report.read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in doc["install"]}


def requires(python: Path, requirements: list[str], report: Path) -> dict[str, list[str]]:
    """What each of `requirements` asks for itself (a `--no-deps` dry run): {name: requires}."""
    argv = [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
            "--no-deps", "--report", str(report)]  # fmt: skip
    _run([*argv, *requirements], 240)
    doc = json.loads(report.read_text())
    return {
        canonicalize_name(i["metadata"]["name"]): list(i["metadata"].get("requires_dist") or [])
        for i in doc["install"]
    }


Resolution = dict[str, str] | dict[str, list[str]] | BaseException


@pytest.fixture(scope="session")
def resolutions(
    resolver: Path, wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[tuple[Install, int], Resolution]]:
    """Every documented install, each step of its build stage resolved, RESOLVERS at a time.
    Failures are kept per case."""
    reports = tmp_path_factory.mktemp("installs-reports")
    jobs: dict[tuple[Install, int], list[str]] = {}
    for case in CASES:
        steps = build_steps(case.variant)[1:]  # [0] is the pip upgrade, done by fresh_venv
        first = _requirements(steps[0], wheel, case.extras)
        jobs[(case, 0)] = first
        # later steps (the GPU stage's onnxruntime-gpu): what they ask for, checked against
        # what the first step installs (pip installs only what is not met already)
        for n, step in enumerate(steps[1:], 1):
            jobs[(case, n)] = _requirements(step, wheel, case.extras)

    def one(key: tuple[Install, int]) -> Resolution:
        case, n = key
        report = reports / f"{case.id}-{n}.json"
        try:
            if n:
                return requires(resolver, jobs[key], report)
            # the GPU image takes PyPI's CUDA build of PyTorch: resolved (metadata only)
            return resolve(resolver, jobs[key], report, pin_torch=case.variant == "cpu")
        except BaseException as exc:  # reported by the case's own test
            return exc

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=RESOLVERS) as pool:
        results = dict(zip(jobs, pool.map(one, jobs), strict=True))
    print(f"\nresolved {len(jobs)} install steps in {time.monotonic() - started:.0f} s")
    yield results


@pytest.mark.timeout(900)  # the first case waits for every resolution
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_documented_install_resolves_in_a_fresh_venv(
    case: Install, resolutions: dict[tuple[Install, int], Resolution]
) -> None:
    steps = {n: r for (c, n), r in resolutions.items() if c == case}
    for result in steps.values():
        if isinstance(result, BaseException):
            raise AssertionError(f"{case.id}, documented at {DOCUMENTED[case]}") from result
    assert isinstance(steps[0], dict)
    first = cast(dict[str, str], steps[0])
    assert first["xsp-sidecar"] == "0.1.0"
    for extra, package in (("pytorch", "torch"), ("tensorflow", "tensorflow"),
                           ("analysis", "pyarrow")):  # fmt: skip
        assert (package in first) == (extra in case.extras), (case.id, package)
    if "pytorch" in case.extras and case.variant == "cpu":
        assert first["torch"].startswith("2.13.0"), first["torch"]  # the pinned CPU build
    if "tensorflow" in case.extras:
        # TensorFlow 2.19's pins, met: protobuf 5 and the tritonclient that takes it
        assert first["tensorflow"] == "2.19.1"
        assert first["protobuf"].startswith("5.") and first["tritonclient"] == "2.66.0", first
    have = {canonicalize_name(k): v for k, v in first.items()}
    for n, result in steps.items():
        if n == 0:
            continue
        assert isinstance(result, dict) and result, (case.id, n, result)
        later = cast(dict[str, list[str]], result)
        # the step changes nothing the first installed: each package they share meets it
        unmet = []
        for package, asks in later.items():
            assert package not in have, (case.id, package)  # a package of its own
            for text in asks:
                req = Requirement(str(text))
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                got = have.get(canonicalize_name(req.name))
                if got is not None and not req.specifier.contains(got, prereleases=True):
                    unmet.append(f"{package} needs {req}, step 1 installs {got}")
        assert unmet == [], (case.id, unmet)
    if case.variant == "gpu":
        assert "onnxruntime-gpu" in cast(dict[str, list[str]], steps[max(steps)])
        assert "cupti-python" in first
        if "pytorch" in case.extras:  # PyPI's CUDA build, beside cupti-python 13
            assert not first["torch"].endswith("+cpu") and "cuda-bindings" in first, first


# -- real installs ------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_tensorflow_extra_installs_and_profiles_a_savedmodel(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A fresh `pip install '.[tensorflow]'`, then `xsp-sidecar profile` on a Keras SavedModel
    built in that venv: layer spans under the Keras layer names."""
    work = tmp_path_factory.mktemp("installs-tensorflow")
    python = fresh_venv(work / "venv")
    _run([str(python), "-m", "pip", "install", "--quiet", f"{wheel}[tensorflow]"], 900)
    models = REPO / "tests" / "harness" / "tfserving" / "models.py"
    build = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('models', {str(models)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import keras; keras.utils.set_random_seed(0)\n"
        f"m.save_model(m.keras_cnn(), {str(work / 'models')!r}, m.CNN)\n"
    )
    # cwd: the scratch folder, so that the checkout's sources cannot shadow the install
    _run([str(python), "-c", build], 300, cwd=work)
    db = work / "traces.db"
    cli = work / "venv" / "bin" / "xsp-sidecar"
    model = work / "models" / "keras_cnn"
    profile = ["profile", str(model), "--levels", "M,L", "--iterations", "2", "--warmup", "1",
               "--no-peak", "--db", str(db)]  # fmt: skip
    _run([str(cli), *profile], 300, cwd=work)
    where = _run([str(python), "-c", "import sidecar; print(sidecar.__file__)"], 60, cwd=work)
    assert where.startswith(str(work / "venv")), where
    with sqlite3.connect(db) as conn:
        runtimes = {r for (r,) in conn.execute("SELECT runtime FROM traces")}
        layers = {n for (n,) in conn.execute("SELECT name FROM spans WHERE level = 'layer'")}
    assert [r.split()[0] for r in runtimes] == ["tensorflow"], runtimes
    assert layers >= CNN_LAYERS, sorted(layers)


@pytest.mark.timeout(600)
def test_an_extra_added_to_an_existing_install_resolves(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The runtime install first (real; its tritonclient protos load under the sidecar's
    modules), then each documented extra resolved against it: for `[tensorflow]` pip must move
    protobuf, numpy and tritonclient down to where TensorFlow 2.19 needs them."""
    work = tmp_path_factory.mktemp("installs-existing")
    python = fresh_venv(work / "venv")
    _run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], 600)
    probe = (
        "import importlib.metadata as m, google.protobuf as p\n"
        "import sidecar.backends.kserve_decode, sidecar.backends.triton_statistics\n"
        "print(m.version('tritonclient'), p.__version__)\n"
    )
    tritonclient, protobuf = _run([str(python), "-c", probe], 120, cwd=work).split()
    assert protobuf.split(".")[0] == "6" and tritonclient != "2.66.0", (tritonclient, protobuf)
    singles = sorted({(e,) for c in CASES for e in c.extras})
    assert ("tensorflow",) in singles, singles

    def add(extras: tuple[str, ...]) -> dict[str, str]:
        spec = f"{wheel}[{','.join(extras)}]"
        return resolve(python, [spec], work / f"{'-'.join(extras)}.json", fresh=False)

    with ThreadPoolExecutor(max_workers=RESOLVERS) as pool:
        got = dict(zip(singles, pool.map(add, singles), strict=True))
    moved = got[("tensorflow",)]
    assert moved["tensorflow"] == "2.19.1", moved
    assert moved["tritonclient"] == "2.66.0" and moved["protobuf"].startswith("5."), moved
    for (extra,), installs in got.items():
        package = {"tensorflow": "tensorflow", "pytorch": "torch", "analysis": "pyarrow"}[extra]
        assert package in installs, (extra, installs)
