"""Are CUPTI's records on the host clock of the walls they were taken in?

Each timed forward is ended by `torch.cuda.synchronize()`, so on a correct clock:
- every launch (the runtime/driver call a GPU record correlates with) starts inside one
  iteration's host wall, and every API call that starts inside a wall ends inside it;
- every GPU record (kernel, memcpy, memset) starts after its launch and ends before the end
  of its launch's wall.
A tolerance covers the conversion between the two clocks. When a second CUPTI client has
run in the process (see `owner`), records come back stretched over 2-3x the wall; this check
turns that into a failed profile with the reason instead of wrong numbers in the store.

It also checks that every GPU record came with the API call that launched it: a kernel whose
launch CUPTI did not record cannot be placed in an iteration or a layer, and would silently
drop out of every sum.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from sidecar.profiling.containment import API_KINDS, GPU_ASYNC_KINDS
from sidecar.profiling.vocabulary import ProfilingError, RawSpan
from sidecar.trace import schema

DEFAULT_TOLERANCE_NS = 50_000


class ClockCheckError(ProfilingError):
    """CUPTI's records do not fit the host walls they were taken in: numbers not stored."""


@dataclass
class ClockCheck:
    """What the check saw; `violations` holds one line per kind of clock violation,
    `missing_launches` counts GPU records without their launching API call."""

    walls: int
    api_records: int = 0
    gpu_records: int = 0
    violations: list[str] = field(default_factory=list)
    missing_launches: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations and not self.missing_launches


def check_clock(
    spans: Sequence[RawSpan],
    walls: Sequence[tuple[int, int]],
    tolerance_ns: int = DEFAULT_TOLERANCE_NS,
) -> ClockCheck:
    """Check kernel-level spans (epoch ns) against the iterations' walls (epoch ns)."""
    order = sorted(range(len(walls)), key=lambda i: walls[i][0])
    starts = [walls[i][0] for i in order]
    tol = tolerance_ns

    def wall_of(t: int, slack: int = tol) -> int | None:
        k = bisect.bisect_right(starts, t + slack) - 1
        if k >= 0:
            w0, w1 = walls[order[k]]
            if w0 - slack <= t <= w1 + slack:
                return order[k]
        return None

    result = ClockCheck(walls=len(walls))
    launches: dict[int, RawSpan] = {}
    api_over: list[float] = []
    for span in spans:
        if span.kind not in API_KINDS:
            continue
        result.api_records += 1
        cid = int(span.attributes.get(schema.CORRELATION_ID, 0))
        prev = launches.get(cid)
        if prev is None or span.start_ns < prev.start_ns:
            launches[cid] = span
        i = wall_of(span.start_ns, 0)  # calls made during the forward end inside it
        if i is not None and span.end_ns > walls[i][1] + tol:
            api_over.append((span.end_ns - walls[i][1]) / 1e6)
    outside: list[float] = []
    late: list[float] = []
    early = 0
    for span in spans:
        if span.kind not in GPU_ASYNC_KINDS:
            continue
        result.gpu_records += 1
        launch = launches.get(int(span.attributes.get(schema.CORRELATION_ID, 0)))
        if launch is None:
            result.missing_launches += 1
        anchor = launch.start_ns if launch is not None else span.start_ns
        i = wall_of(anchor)
        if i is None:
            first = starts[0] if starts else anchor
            outside.append((anchor - first) / 1e6)
            continue
        if span.end_ns > walls[i][1] + tol:
            late.append((span.end_ns - walls[i][1]) / 1e6)
        if launch is not None and span.start_ns < launch.start_ns - tol:
            early += 1
    if outside:
        result.violations.append(
            f"{len(outside)} of {result.gpu_records} GPU records were launched outside every "
            f"host wall (launches up to {max(outside):.2f} ms after the first wall started)"
        )
    if late:
        result.violations.append(
            f"{len(late)} GPU records end after their forward's synchronised wall (by up to "
            f"{max(late):.3f} ms)"
        )
    if early:
        result.violations.append(f"{early} GPU records start before the call that launched them")
    if api_over:
        result.violations.append(
            f"{len(api_over)} API calls end after their wall (by up to {max(api_over):.3f} ms)"
        )
    return result


def require_clock(
    spans: Sequence[RawSpan],
    walls: Sequence[tuple[int, int]],
    tolerance_ns: int = DEFAULT_TOLERANCE_NS,
) -> ClockCheck:
    """`check_clock`, raising `ClockCheckError` with the reasons when it fails."""
    result = check_clock(spans, walls, tolerance_ns)
    reasons: list[str] = []
    if result.violations:
        reasons.append(
            "CUPTI's records are not on the host clock of the timed forwards ("
            + "; ".join(result.violations)
            + "). This happens when another CUPTI client (e.g. torch.profiler) ran earlier in "
            "the same process; profile in a fresh process."
        )
    if result.missing_launches:
        reasons.append(
            f"{result.missing_launches} of {result.gpu_records} GPU records came without the "
            "API call that launched them (CUPTI did not record those launches), so they cannot "
            "be placed in a layer or an iteration and would be missing from every sum."
        )
    if reasons:
        raise ClockCheckError("kernel level rejected: " + " ".join(reasons))
    return result
