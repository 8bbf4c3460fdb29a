from __future__ import annotations

from sidecar.profiling.containment import assign_parents, number_siblings
from sidecar.trace.spans import Level, Source, Span


def span(level: Level, name: str, start: int, end: int, kind: str = "x") -> Span:
    return Span("t" * 32, name, None, level, name, kind, start, end, Source.REPLAY)


def test_parent_is_the_container_exactly_one_level_up() -> None:
    m = span(Level.MODEL, "m", 0, 100)
    a = span(Level.LAYER, "a", 10, 40)
    b = span(Level.LAYER, "b", 50, 90)
    k1 = span(Level.KERNEL, "k1", 12, 20)
    k2 = span(Level.KERNEL, "k2", 60, 70)
    spans = [m, a, b, k1, k2]
    assign_parents(spans)
    assert m.parent_id is None
    assert a.parent_id == "m" and b.parent_id == "m"
    assert k1.parent_id == "a" and k2.parent_id == "b"  # never the model: one level up only
    number_siblings(spans)
    assert (a.index, b.index) == (0, 1)


def test_overlapping_candidates_are_flagged_not_guessed() -> None:
    m = span(Level.MODEL, "m", 0, 100)
    a = span(Level.LAYER, "a", 10, 60)
    b = span(Level.LAYER, "b", 20, 80)  # parallel layer overlapping a
    k = span(Level.KERNEL, "k", 30, 40)  # inside both
    orphan = span(Level.KERNEL, "o", 85, 95)  # inside no layer
    assign_parents([m, a, b, k, orphan])
    assert k.parent_id is None
    assert k.attributes["parent_ambiguous"] is True
    assert sorted(k.attributes["parent_candidates"]) == ["a", "b"]
    assert orphan.parent_id is None and orphan.attributes["parent_missing"] is True
    assert "parent_ambiguous" not in a.attributes


def test_containment_edges_are_inclusive() -> None:
    m = span(Level.MODEL, "m", 0, 100)
    a = span(Level.LAYER, "a", 0, 100)
    assign_parents([m, a])
    assert a.parent_id == "m"
