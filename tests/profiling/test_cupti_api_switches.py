"""Which runtime/driver calls `CuptiTracer` asks CUPTI to record.

No GPU exists here, so CUPTI is a FAKE: `FakeCuptiSwitches` takes the activity-API calls
`CuptiTracer.start` makes and answers which API calls a GPU would then record, by the rules
a real card showed once a CUDA context exists (CUPTI 13.0, as recorded by a public CUPTI
conformance test):
- a kind that is on records every call except those switched off after it went on;
- enabling a kind forgets earlier switches;
- a runtime call switched on while its kind is off records nothing (a driver call does).
The callback-id tables are cupti-python's own. Both H100 recordings' launches (runtime
`cudaLaunchKernel`/`cudaLaunchKernelExC`, driver `cuLaunchKernel`) must be recorded.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from sidecar.profiling.gpu import cupti_tracer as ct
from sidecar.profiling.gpu.owner import CuptiOwner

cupti = pytest.importorskip("cupti.cupti")

LAUNCHES = [
    ("runtime", "cudaLaunchKernel"),
    ("runtime", "cudaLaunchKernelExC"),
    ("runtime", "cudaMemcpyAsync"),
    ("runtime", "cudaMemsetAsync"),
    ("runtime", "cudaGraphLaunch"),
    ("driver", "cuLaunchKernel"),
    ("driver", "cuLaunchKernelEx"),
    ("driver", "cuMemsetD32Async"),
]
NOT_LAUNCHES = [
    ("runtime", "cudaMalloc"),
    ("runtime", "cudaStreamSynchronize"),
    ("runtime", "cudaEventRecord"),
    ("runtime", "cudaGetDevice"),
    ("driver", "cuCtxGetCurrent"),
    ("driver", "cuMemAlloc"),
]


def cbid(domain: str, name: str) -> int:
    for member in ct.cbid_table(cupti, domain):
        if re.sub(r"_v\d+$", "", member.name) == name:
            return int(member)
    raise KeyError(name)


class FakeCuptiSwitchesNoTables(types.ModuleType):
    """FAKE `cupti.cupti`: the activity switches, with a context already created (the
    callback-id tables are added by the subclasses, under each version's names)."""

    ActivityKind = cupti.ActivityKind

    def __init__(self) -> None:
        super().__init__("cupti.cupti")
        self.kinds: set[int] = set()
        self.off: dict[str, set[int]] = {"runtime": set(), "driver": set()}
        self.on: dict[str, set[int]] = {"runtime": set(), "driver": set()}

    @staticmethod
    def _domain(kind: Any) -> str | None:
        domains = {cupti.ActivityKind.RUNTIME: "runtime", cupti.ActivityKind.DRIVER: "driver"}
        return {int(k): v for k, v in domains.items()}.get(int(kind))

    def activity_register_callbacks(self, requested: Any, completed: Any) -> None:
        pass

    def activity_enable(self, kind: Any) -> None:
        self.kinds.add(int(kind))
        domain = self._domain(kind)
        if domain is not None:  # enabling a kind forgets earlier switches
            self.off[domain].clear()
            self.on[domain].clear()

    def activity_disable(self, kind: Any) -> None:
        self.kinds.discard(int(kind))

    def _switch(self, domain: str, cbid: int, enable: int) -> None:
        if not 0 <= cbid < 2**31 - 1:
            raise ValueError("CUPTI_ERROR_INVALID_PARAMETER")
        (self.on if enable else self.off)[domain].add(cbid)
        (self.off if enable else self.on)[domain].discard(cbid)

    def activity_enable_runtime_api(self, cbid: int, enable: int) -> None:
        self._switch("runtime", cbid, enable)

    def activity_enable_driver_api(self, cbid: int, enable: int) -> None:
        self._switch("driver", cbid, enable)

    def get_timestamp(self) -> int:
        return 0

    def activity_flush_all(self, flag: int) -> None:
        pass

    def records(self, domain: str, name: str) -> bool:
        """Would a call of `name` leave an activity record now?"""
        kind = cupti.ActivityKind.RUNTIME if domain == "runtime" else cupti.ActivityKind.DRIVER
        call = cbid(domain, name)
        if int(kind) in self.kinds:
            return call not in self.off[domain]
        return domain == "driver" and call in self.on[domain]


class FakeCuptiSwitches(FakeCuptiSwitchesNoTables):
    """FAKE `cupti.cupti` of cupti-python 13.1 and later: CamelCase callback-id tables."""

    RuntimeApiTraceCbid = ct.cbid_table(cupti, "runtime")
    DriverApiTraceCbid = ct.cbid_table(cupti, "driver")


class FakeCupti130Switches(FakeCuptiSwitchesNoTables):
    """FAKE `cupti.cupti` of cupti-python 13.0.x (the one matching a CUDA 13.0 driver):
    the same tables, named in snake_case."""

    runtime_api_trace_cbid = ct.cbid_table(cupti, "runtime")
    driver_api_trace_cbid = ct.cbid_table(cupti, "driver")


def install(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> None:
    package = types.ModuleType("cupti")
    package.cupti = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupti", package)
    monkeypatch.setitem(sys.modules, "cupti.cupti", module)
    ct.api_name.cache_clear()  # names cached from the real module


@pytest.fixture(params=[FakeCuptiSwitches, FakeCupti130Switches], ids=["13.1+", "13.0"])
def fake(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeCuptiSwitchesNoTables]:
    """Each test under both namings of the callback-id tables: without the 13.0.x names the
    tracer recorded every API call there and named launches `runtime:cbid=211`."""
    module = request.param()
    install(monkeypatch, module)
    yield module
    ct.api_name.cache_clear()  # names cached from the fake


def started(all_api: bool = False) -> ct.CuptiTracer:
    tracer = ct.CuptiTracer(all_api=all_api, owner=CuptiOwner())
    tracer.start()
    return tracer


def test_launches_are_recorded_and_nothing_else(fake: FakeCuptiSwitchesNoTables) -> None:
    tracer = started()
    assert tracer.api_filter == "cbid"
    for domain, name in LAUNCHES:
        assert fake.records(domain, name), name
    for domain, name in NOT_LAUNCHES:
        assert not fake.records(domain, name), name
    tracer.stop()
    assert not fake.kinds  # every kind it enabled is off again


def test_a_second_start_switches_off_again(fake: FakeCuptiSwitchesNoTables) -> None:
    """Enabling the kinds again forgets the switches; each start sets them anew."""
    started().stop()
    started()
    assert fake.records("runtime", "cudaLaunchKernel")
    assert not fake.records("runtime", "cudaMalloc")


def test_all_api_records_every_call(fake: FakeCuptiSwitchesNoTables) -> None:
    tracer = started(all_api=True)
    assert tracer.api_filter == "none"
    for domain, name in LAUNCHES + NOT_LAUNCHES:
        assert fake.records(domain, name), name


def test_without_switches_every_call_is_recorded_and_filtered_at_stop(
    fake: FakeCuptiSwitchesNoTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older cupti-python without per-function switches: record all, drop at stop()."""
    monkeypatch.delattr(FakeCuptiSwitchesNoTables, "activity_enable_runtime_api")
    tracer = started()
    assert tracer.api_filter == "after-stop"
    assert fake.records("runtime", "cudaLaunchKernel") and fake.records("runtime", "cudaMalloc")


def test_a_cupti_python_that_cannot_record_runtime_calls_is_named(
    fake: FakeCuptiSwitchesNoTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cupti-python 12 has no ActivityKind.RUNTIME (13.0 added it): K says so, instead of
    "needs an NVIDIA GPU and driver"."""
    kinds = types.SimpleNamespace(
        **{k: getattr(cupti.ActivityKind, k) for k in ("CONCURRENT_KERNEL", "MEMCPY", "MEMSET")}
    )
    monkeypatch.setattr(type(fake), "ActivityKind", kinds)
    owner = CuptiOwner()
    with pytest.raises(ct.GpuNotAvailableError, match="needs cupti-python 13 or newer"):
        ct.CuptiTracer(owner=owner).start()
    assert owner.owner is None


def test_launches_are_named_from_either_table(fake: FakeCuptiSwitchesNoTables) -> None:
    if isinstance(fake, FakeCupti130Switches):
        assert not hasattr(fake, "RuntimeApiTraceCbid")
    assert ct.api_name("runtime", cbid("runtime", "cudaLaunchKernel")) == "cudaLaunchKernel"


def test_a_cupti_without_callback_id_tables_is_said_so() -> None:
    with pytest.raises(AttributeError, match="runtime callback-id table"):
        ct.cbid_table(types.ModuleType("cupti.cupti"), "runtime")
