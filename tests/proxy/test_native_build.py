"""The relay's C extensions are built where a compiler exists, say which paths run, and reach
only the Python names `native.INTERFACE` declares.

Nothing here skips for a missing extension: a build that failed fails these tests (and the
set-up check, `native_check --require`). Each extension's `NAMES` (what its C code interns)
is compared with the declaration, and each name is looked up on a real object of the class
it is declared for, so renaming one on the Python side fails here, not on the hot path.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.proxy import frames, native, native_check, relay, stream_messages
from sidecar.proxy.frames import FrameScanner
from sidecar.proxy.http import relay as http_relay
from sidecar.proxy.http.calls import CallBook
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.native_paths import NativeInfo, describe, paths
from sidecar.proxy.streams import ConnectionTracker
from sidecar.sampling.sampler import Sampler
from sidecar.sampling.settings import SamplingSettings
from tests.harness.process import free_port
from tests.proxy.test_proxy_serve import wait_listening

HAS_CC = native_check.compiler() is not None


def _tracker() -> ConnectionTracker:
    return ConnectionTracker(ProxyMetrics(CollectorRegistry()))


# Real objects of the declared classes whose attributes are set in `__init__`.
INSTANCES: dict[str, Callable[[], object]] = {
    "sidecar.proxy.frames:FrameScanner": lambda: _tracker().request_scanner,
    "sidecar.proxy.streams:ConnectionTracker": _tracker,
    "sidecar.proxy.metrics:ProxyMetrics": lambda: ProxyMetrics(CollectorRegistry()),
    "sidecar.sampling.sampler:Sampler": lambda: Sampler(SamplingSettings()),
    "sidecar.proxy.http.calls:CallBook": lambda: CallBook(
        ProxyMetrics(CollectorRegistry()), None, 1
    ),
}


def owner(path: str) -> type:
    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type), path
    return cls


def names_of(path: str) -> set[str]:
    """Every attribute a `path` ("module:Class") object has: its class's, its dataclass or
    named-tuple fields, and where `INSTANCES` makes one, a real instance's."""
    cls = owner(path)
    names = set(dir(cls)) | set(getattr(cls, "_fields", ()))
    if dataclasses.is_dataclass(cls):
        names |= {field.name for field in dataclasses.fields(cls)}
    if path in INSTANCES:
        names |= set(dir(INSTANCES[path]()))
    return names


def undeclared(extension: str) -> list[str]:
    """The names `extension`'s C code uses that its declared class lacks ("name -> class")."""
    return [
        f"{name} -> {path}"
        for name, path in native.INTERFACE[extension].items()
        if name not in names_of(path)
    ]


# -- the build ---------------------------------------------------------------------------------


@pytest.mark.parametrize("extension", native.EXTENSIONS)
def test_every_extension_imports_where_a_compiler_exists(extension: str) -> None:
    """`pip install` (scripts/setup.sh, CI, the image) builds all three; the pure-Python
    fallback is for a machine with no C compiler, whatever `XSP_NATIVE` says."""
    if not HAS_CC:
        pytest.skip("no C compiler here: the relay runs its pure-Python paths")
    assert native_check.import_error(extension) is None


def test_the_relay_runs_every_c_path_unless_switched_off() -> None:
    on = native.ENABLED and HAS_CC
    assert paths() == {"walk": on, "pump": on, "message_walk": on, "http_pump": on}
    assert (frames.native_walk is not None) is on
    assert (relay.native_pump is not None) is on
    assert (stream_messages.native_readers is not None) is on
    assert (http_relay.native_http_pump is not None) is on


def test_the_check_passes_here_and_names_a_missing_extension_with_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not HAS_CC:
        pytest.skip("no C compiler here")
    assert native_check.main(["--require"]) == 0
    assert "built: _framewalk, _pump, _messagewalk, _httppump" in capsys.readouterr().out
    log = tmp_path / "setup.log"
    log.write_text(
        "building 'sidecar.proxy._pump' extension\n"
        "sidecar/proxy/_pump.c:47:1: error: unknown type name 'junk'\n"
        'warning: building optional extension "sidecar.proxy._pump" failed\n'
    )
    real = native_check.import_error
    monkeypatch.setattr(
        native_check, "import_error", lambda name: "gone" if name == "_pump" else real(name)
    )
    assert native_check.main(["--require", "--log", str(log)]) == 1
    out = capsys.readouterr()
    assert "sidecar.proxy._pump did not build" in out.out
    assert "_pump.c:47:1: error: unknown type name 'junk'" in out.out
    assert "not built: _pump" in out.err
    assert native_check.main([]) == 0  # without --require it only reports


# -- which paths run: /metrics and the log -------------------------------------------------------


def test_the_info_gauge_says_which_paths_run(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    registry.register(NativeInfo())
    on = "on" if paths()["walk"] else "off"
    switch = "on" if native.ENABLED else "off"
    labels = {"walk": on, "pump": on, "message_walk": on, "http_pump": on, "switch": switch}
    assert registry.get_sample_value("xsp_relay_native_info", labels) == 1
    monkeypatch.setattr(frames, "native_walk", None)  # no walk: no pump either
    off = {**labels, "walk": "off", "pump": "off"}
    assert registry.get_sample_value("xsp_relay_native_info", off) == 1
    assert "walk off" in describe() and "pump off" in describe()


def test_xsp_native_off_switches_every_c_path_off() -> None:
    script = (
        "from prometheus_client import CollectorRegistry, generate_latest\n"
        "from sidecar.proxy import native\n"
        "from sidecar.proxy.native_paths import NativeInfo, describe\n"
        "registry = CollectorRegistry(); registry.register(NativeInfo())\n"
        "print(describe()); print(generate_latest(registry).decode())\n"
    )
    env = {**os.environ, native.ENV: "off"}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "walk off (XSP_NATIVE=off), pump off (XSP_NATIVE=off), message_walk off" in run.stdout
    assert "http_pump off (XSP_NATIVE=off)" in run.stdout
    assert (
        'xsp_relay_native_info{http_pump="off",message_walk="off",pump="off",switch="off",'
        'walk="off"} 1.0' in run.stdout
    )


def test_serve_logs_the_paths_once_and_exports_the_gauge() -> None:
    """`serve` with `XSP_NATIVE=off`: its start says so once, in the log and on /metrics."""
    listen, metrics = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XSP_")}
    cmd = [sys.executable, "-m", "sidecar", "serve", "--backend", f"127.0.0.1:{free_port()}",
           "--listen", f"127.0.0.1:{listen}", "--metrics-port", str(metrics),
           "--grpc-port", str(free_port())]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env, native.ENV: "off"},
    )  # fmt: skip
    try:
        wait_listening(listen, proc)
        # the start line comes after the listener is up: read up to it before stopping serve
        # (a loaded machine's SIGTERM once came first); pytest's timeout bounds the wait
        assert proc.stdout is not None
        seen = []
        while not seen or "relay C paths:" not in seen[-1]:
            line = proc.stdout.readline()
            assert line, "".join(seen)  # serve ended without its start line
            seen.append(line)
        url = f"http://127.0.0.1:{metrics}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            exposition = response.read().decode()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=20)
        out = "".join(seen) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    gauge = (
        'xsp_relay_native_info{http_pump="off",message_walk="off",pump="off",switch="off",'
        'walk="off"} 1.0'
    )
    assert gauge in exposition
    assert out.count("relay C paths:") == 1, out
    assert "walk off (XSP_NATIVE=off)" in out


# -- the declared interface ----------------------------------------------------------------------


@pytest.mark.parametrize("extension", native.EXTENSIONS)
def test_the_names_an_extension_interns_are_declared_and_public(extension: str) -> None:
    module = importlib.import_module(f"sidecar.proxy.{extension}")
    names = module.NAMES
    assert len(set(names)) == len(names)
    assert set(names) == set(native.INTERFACE[extension])
    assert [name for name in names if name.startswith("_")] == []


@pytest.mark.parametrize("extension", native.EXTENSIONS)
def test_every_name_the_c_code_uses_exists_on_its_class(extension: str) -> None:
    assert undeclared(extension) == []


def test_the_relay_sinks_have_every_sink_method() -> None:
    """`FrameSink` is a Protocol: the walk's real sinks are the tracker's two sides."""
    tracker = _tracker()
    sink_names = [n for n, p in native.INTERFACE["_framewalk"].items() if p.endswith(":FrameSink")]
    for side in (tracker.request, tracker.response):
        assert [name for name in sink_names if not hasattr(side, name)] == []


def test_a_renamed_name_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a rename on the Python side looks like to the check."""
    monkeypatch.delattr(FrameScanner, "observe_rest")
    monkeypatch.delattr(Sampler, "at_headers")  # not a name the C code uses: not reported
    assert undeclared("_pump") == ["observe_rest -> sidecar.proxy.frames:FrameScanner"]
