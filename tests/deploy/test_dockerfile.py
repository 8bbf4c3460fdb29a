"""Static checks of the Dockerfile (no Docker engine runs here, so the image is not built)."""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest

from tests.deploy.helpers import REPO, container, load_values_file, manifests, one, render

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


def parse() -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with line continuations joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(words[0], name))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, got {keyword}"
            key, _, default = rest.partition("=")
            global_args[key] = default.strip('"')
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)


def ignored(path: str) -> bool:
    """.dockerignore semantics, simplified: last matching pattern wins; parents count."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            result = not negate
    return result


def _stage(stages: list[Stage], name: str) -> Stage:
    found = [s for s in stages if s.name == name]
    assert found, f"no stage {name!r}"
    return found[0]


def test_variant_selects_a_runtime_stage_for_cpu_and_gpu() -> None:
    args, stages = parse()
    assert args["VARIANT"] == "cpu"
    final = stages[-1]
    assert final.base == "runtime-${VARIANT}"
    names = [s.name for s in stages]
    for variant in ("cpu", "gpu"):
        runtime = _stage(stages, expand(final.base, {**args, "VARIANT": variant}))
        [copy] = runtime.all("COPY")
        source_stage = re.search(r"--from=(\S+)", copy)
        assert source_stage and source_stage.group(1) == f"build-{variant}"
        assert names.index(f"build-{variant}") < names.index(runtime.name)
        assert "/opt/venv" in copy


def test_cpu_image_is_python_slim_and_gpu_image_is_cuda() -> None:
    args, stages = parse()
    assert expand(_stage(stages, "build-cpu").base, args) == "python:3.11-slim"
    assert expand(_stage(stages, "runtime-cpu").base, args) == "python:3.11-slim"
    assert expand(_stage(stages, "base-gpu").base, args).startswith("nvidia/cuda:12.")
    gpu_build = " ".join(
        _stage(stages, "build-gpu").all("RUN") + _stage(stages, "build-gpu").all("ARG")
    )
    assert "onnxruntime-gpu" in gpu_build and "cupti-python" in gpu_build
    # cupti-python 12 cannot record runtime API calls: the build checks it can
    assert 'CUPTI_SPEC="cupti-python>=13.0.1,<14"' in gpu_build
    assert "cupti.ActivityKind.RUNTIME" in gpu_build
    assert "pip uninstall -y onnxruntime" in gpu_build  # the CPU wheel would shadow the GPU one
    # documented: the GPU variant with PyTorch, under the tag the chart's sidecar.gpu uses
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    assert "-t xsp-sidecar:0.1.0-gpu --build-arg VARIANT=gpu --build-arg EXTRAS=[pytorch]" in header
    gpu = container(
        one(manifests(render({"sidecar": {"gpu": {"enabled": True}}})), "Deployment"), "sidecar"
    )
    assert gpu["image"] == "xsp-sidecar:0.1.0-gpu"


def test_builds_install_the_package_from_the_source_tree() -> None:
    _, stages = parse()
    for name in ("build-cpu", "build-gpu"):
        runs = " ".join(_stage(stages, name).all("RUN"))
        assert 'pip install ".${EXTRAS}"' in runs, name
        # the relay's C frame and message walkers are built there (a compiler in the build
        # stage only) and a build that silently fell back to pure Python fails the image build
        assert "gcc" in runs and 'python -c "import sidecar.proxy._framewalk"' in runs, name
        assert 'python -c "import sidecar.proxy._messagewalk"' in runs, name
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "pytorch" in extras  # what EXTRAS=[pytorch] selects
    # EXTRAS=[tensorflow]: the image beside TF-Serving (replays SavedModels, its Predict protos)
    assert {"tensorflow", "tensorflow-serving-api"} <= {
        req.split("=")[0].split("<")[0].split(">")[0] for req in extras["tensorflow"]
    }
    header = (REPO / "Dockerfile").read_text().split("\nARG ", 1)[0]
    assert "--build-arg EXTRAS=[tensorflow]" in header  # documented


def test_runtime_image_has_no_analysis_stack_unless_asked() -> None:
    args, _ = parse()
    assert args["EXTRAS"] == ""  # the default image: the sidecar's own dependencies only
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    stack = {"pandas", "matplotlib", "duckdb"}
    runtime = {re.split(r"[\[<>=!~ ;]", req)[0].lower() for req in project["dependencies"]}
    assert not stack & runtime
    analysis = project["optional-dependencies"]["analysis"]
    assert stack <= {re.split(r"[\[<>=!~ ;]", req)[0].lower() for req in analysis}
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    assert "--build-arg EXTRAS=[analysis]" in header  # documented, with what it adds
    assert "no pandas, matplotlib or duckdb" in header


def test_final_image_runs_as_a_user_with_a_grpc_health_check() -> None:
    _, stages = parse()
    final = stages[-1]
    [user] = final.all("USER")
    assert user.split(":")[0] not in {"0", "root"}
    [healthcheck] = final.all("HEALTHCHECK")
    command = healthcheck.split("CMD", 1)[1].strip()
    assert command.startswith("[") and "xsp-healthcheck" in command
    copies = [shlex.split(c) for c in final.all("COPY")]
    assert ["--chmod=0755", "docker/healthcheck.py", "/usr/local/bin/xsp-healthcheck"] in copies
    assert final.all("ENTRYPOINT") == ['["xsp-sidecar"]']
    exposed = {p for e in final.all("EXPOSE") for p in e.split()}
    sidecar = load_values_file("values.yaml")["sidecar"]  # the chart's ports
    ports = [sidecar[p] for p in ("listenPort", "metricsPort", "grpcPort", "otlpPort")]
    assert exposed == {str(p) for p in [*ports, sidecar["http"]["listenPort"]]}
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "xsp-sidecar" in scripts


def test_chart_liveness_uses_the_script_the_image_installs() -> None:
    sidecar = container(one(manifests(render()), "Deployment"), "sidecar")
    assert sidecar["livenessProbe"]["exec"]["command"][0] == "xsp-healthcheck"
    assert sidecar["securityContext"]["runAsUser"] == 10001
    _, stages = parse()
    assert stages[-1].all("USER") == ["10001:10001"]


@pytest.mark.parametrize("stage_name", ["build-cpu", "build-gpu", "final"])
def test_copied_sources_exist_and_reach_the_build_context(stage_name: str) -> None:
    _, stages = parse()
    for copy in _stage(stages, stage_name).all("COPY"):
        words = [w for w in shlex.split(copy) if not w.startswith("--")]
        if "--from=" in copy:
            continue
        for source in words[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert not ignored(source), f"COPY {source}: excluded by .dockerignore"


def test_dockerignore_keeps_secrets_and_junk_out() -> None:
    for path in (
        ".venv/bin/python",
        ".git/config",
        "tests/deploy/helpers.py",
        "tests/harness/triton/server.py",  # the test harness never reaches the image
        "tests/harness/demo/__main__.py",
        "traces.db",
        "sidecar/__pycache__/cli.cpython-311.pyc",
        "helm/xsp-sidecar/values.yaml",
    ):
        assert ignored(path), path
    for path in ("pyproject.toml", "README.md", "sidecar/cli.py", "docker/healthcheck.py"):
        assert not ignored(path), path
