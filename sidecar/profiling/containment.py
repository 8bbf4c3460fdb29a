"""Parent assignment by interval containment (XSP correlation).

A span's parent is the span exactly one replay level up (K -> L -> M) whose interval contains
it on the trace's single clock. When the candidates nest (module `layer1` contains
`layer1.0` contains `layer1.0.conv1`), the innermost one is the parent. When candidates that
do not nest contain a span (parallel layers) the span is flagged `parent_ambiguous` with its
`parent_candidates` and left without a parent rather than guessed; a span no candidate
contains is flagged `parent_missing`.
Asynchronous GPU activity (kernels, memcpys, memsets) is placed by its launch instead, with
the same innermost rule on the layers' host intervals: see `gpu.attribution`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from sidecar.trace import schema
from sidecar.trace.spans import Level, Span

GPU_ASYNC_KINDS = frozenset({"kernel", "memcpy", "memset"})
API_KINDS = frozenset({"runtime", "driver"})  # CUDA calls on the host, launches among them


class Interval(Protocol):
    """A span as containment reads it: a stored `Span` or a runner's `RawSpan`."""

    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


S = TypeVar("S", bound=Interval)


def own_interval(span: Interval) -> tuple[int, int]:
    return span.start_ns, span.end_ns


def is_gpu_async(span: Span) -> bool:
    """True for GPU-side activity that runs after its launch (placed by correlation id)."""
    return span.level is Level.KERNEL and span.kind in GPU_ASYNC_KINDS


def assign_parents(spans: Sequence[Span]) -> None:
    """Set `parent_id` of every replay span below M from interval containment, in place."""
    by_depth: dict[int, list[Span]] = {}
    for span in spans:
        if span.level.depth >= 0:
            by_depth.setdefault(span.level.depth, []).append(span)
    for depth in sorted(by_depth):
        if depth == 0:
            continue
        parents = by_depth.get(depth - 1, [])
        starts = np.array([p.start_ns for p in parents], dtype=np.int64)
        ends = np.array([p.end_ns for p in parents], dtype=np.int64)
        for child in by_depth[depth]:
            if is_gpu_async(child):
                continue
            hits = np.nonzero((starts <= child.start_ns) & (ends >= child.end_ns))[0]
            _place(child, [parents[i] for i in hits])


def _place(child: Span, candidates: list[Span]) -> None:
    set_parent(child, candidates, innermost(candidates))


def set_parent(child: Span, candidates: Sequence[Span], inner: Span | None) -> None:
    """Give `child` the parent `inner` chose among `candidates` (the spans containing it), or
    flag it: `parent_ambiguous` with `parent_candidates` when some did but none was innermost,
    `parent_missing` when none did."""
    child.attributes.pop(schema.PARENT_AMBIGUOUS, None)
    child.attributes.pop(schema.PARENT_CANDIDATES, None)
    child.attributes.pop(schema.PARENT_MISSING, None)
    if inner is not None:
        child.parent_id = inner.span_id
        return
    child.parent_id = None
    if candidates:
        child.attributes[schema.PARENT_AMBIGUOUS] = True
        child.attributes[schema.PARENT_CANDIDATES] = [c.span_id for c in candidates]
    else:
        child.attributes[schema.PARENT_MISSING] = True


def innermost(
    candidates: Sequence[S], interval: Callable[[S], tuple[int, int]] = own_interval
) -> S | None:
    """The one candidate inside all others (nested layers), or None: the shortest `interval`,
    the deeper `depth` attribute among equal ones; None if another candidate does not contain
    it (parallel layers)."""
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]

    def length(c: S) -> int:
        start, end = interval(c)
        return end - start

    ordered = sorted(candidates, key=lambda c: (length(c), -int(c.attributes.get(schema.DEPTH, 0))))
    inner = ordered[0]
    i0, i1 = interval(inner)
    for outer in ordered[1:]:
        o0, o1 = interval(outer)
        if not (o0 <= i0 and i1 <= o1):
            return None
    return inner


def number_siblings(spans: Sequence[Span]) -> None:
    """Set `index` to the execution order among siblings (same parent and level), in place."""
    groups: dict[tuple[str | None, Level], list[Span]] = {}
    for span in spans:
        groups.setdefault((span.parent_id, span.level), []).append(span)
    for group in groups.values():
        for i, span in enumerate(sorted(group, key=_execution_order)):
            span.index = i


def _execution_order(span: Span) -> tuple[int, int, int]:
    """Start time; for nested layers starting together (`layer1`, `layer1.0`,
    `layer1.0.conv1` share their first kernel) the enclosing call first."""
    return (span.start_ns, int(span.attributes.get(schema.DEPTH, 0)), span.end_ns)
