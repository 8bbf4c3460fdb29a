"""Which parts of a sampled trace are in the store, and when the trace is final.

A sampled request's trace arrives in up to three parts, in any order (`Part`): the relay's
request span, the backend's own spans and the replay. The state of each sampled trace is one
row of table `trace_parts` (migration 2): the parts expected, those received, those that will
never come and why (`absent`), a deadline, and the outcome. `advance` moves it on inside the
transaction that writes a part, so the state and the part are committed together and a
restart loses nothing.

A trace is final once no expected part is outstanding: `whole` when every expected part was
received, `incomplete` when a part is absent (the backend's tracing is off, the replay was
refused) or its deadline passed first (`timeout`: deadlines pass only by an `Event`'s
`expire_at_ns`, on the assembler's clock). Then, once, the trace's `fidelity` is
computed (`fidelity.refresh`) and its outcome is written as trace attribute `assembly`
(`record`). A part that arrives after that (late) is stored and the trace is final again with
it. A part that comes before its trace's expectation is kept (`expected` NULL) until the
expectation comes. A trace with no `trace_parts` row (written by `xsp-sidecar profile`, or
whole in one write) gets its `fidelity` refreshed on every write, as before.
"""

from __future__ import annotations

import enum
import json
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.trace import fidelity, schema

ATTRIBUTE = schema.ASSEMBLY  # the trace attribute holding the outcome
TABLE = "trace_parts"

PENDING, WHOLE, INCOMPLETE = "pending", "whole", "incomplete"
TIMEOUT = "timeout"


class Part(enum.StrEnum):
    """One part of a sampled trace."""

    REQUEST = "request"  # the relay's request span (source proxy)
    BACKEND = "backend"  # the backend's own spans (OTLP or a profiler capture)
    REPLAY = "replay"  # the replay: trace row, replay spans, level statistics


@dataclass(frozen=True)
class Expected:
    """What one sampled trace will get: `parts` to wait for until `deadline_ns` (epoch ns),
    and the parts that will never come with why (`absent`)."""

    trace_id: str
    parts: frozenset[Part]
    deadline_ns: int
    absent: Mapping[Part, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    """What one write tells the assembly (`PendingWrite.assembly`): a trace is `expected`,
    parts were `received` or will never come (`absent`, with why), or every pending trace
    whose deadline is at or before `expire_at_ns` is final now."""

    expected: Expected | None = None
    received: frozenset[Part] = frozenset()
    absent: Mapping[Part, str] = field(default_factory=dict)
    expire_at_ns: int | None = None


@dataclass(frozen=True)
class State:
    """One `trace_parts` row."""

    trace_id: str
    expected: frozenset[Part] | None  # None: parts came before the trace's expectation
    received: frozenset[Part]
    absent: Mapping[Part, str]
    deadline_ns: int
    state: str
    why: str

    @property
    def outstanding(self) -> frozenset[Part]:
        """Expected parts neither received nor known to be absent."""
        return (self.expected or frozenset()) - self.received - frozenset(self.absent)

    @property
    def missing(self) -> list[str]:
        """Expected parts not received, sorted (for the `assembly` attribute)."""
        return sorted(p.value for p in (self.expected or frozenset()) - self.received)

    def record(self) -> dict[str, Any]:
        """The trace attribute `assembly`."""
        return {
            schema.ASSEMBLY_STATE: self.state,
            schema.ASSEMBLY_MISSING: self.missing,
            schema.ASSEMBLY_WHY: self.why,
        }


def advance(conn: sqlite3.Connection, events: Iterable[tuple[str, Event | None, bool]]) -> None:
    """Apply one transaction's writes (inside it). `events`: per write, its trace id (`""`
    for none), its assembly event (None: none) and whether it wrote the trace row. Deadlines
    pass only by an event's `expire_at_ns` (the assembler's clock)."""
    final: set[str] = set()  # traces whose outcome is (written) again
    legacy: list[str] = []
    for trace_id, event, wrote_row in events:
        if event is not None and event.expected is not None:
            _insert(conn, event.expected)
        if event is not None and event.expire_at_ns is not None:
            for tid in _overdue(conn, event.expire_at_ns):
                if _settle(conn, _load(conn, tid), timed_out=True):
                    final.add(tid)
        if not trace_id:
            continue
        state = _load(conn, trace_id)
        if state is None and event is not None and event.received:
            state = _early(conn, trace_id)
        if state is None:
            legacy.append(trace_id)
            continue
        changed = event is not None and _update(conn, state, event)
        was_final = state.state != PENDING
        if changed:
            state = _load(conn, trace_id)
        if state is None:
            continue
        if (changed or not was_final) and _settle(conn, state, timed_out=was_final):
            final.add(trace_id)
        elif wrote_row and was_final:
            final.add(trace_id)  # the row was replaced: its outcome goes on again
    for trace_id in final:
        _write_outcome(conn, trace_id)
    fidelity.refresh(conn, legacy)


def pending(conn: sqlite3.Connection) -> list[State]:
    """Traces still waiting for a part, soonest deadline first."""
    rows = conn.execute(
        f"SELECT trace_id FROM {TABLE} WHERE state = ? AND expected IS NOT NULL "
        "ORDER BY deadline_ns",
        (PENDING,),
    ).fetchall()
    return [s for (tid,) in rows if (s := _load(conn, tid)) is not None]


def load(conn: sqlite3.Connection, trace_id: str) -> State | None:
    """The state of one trace (None: not assembled)."""
    return _load(conn, trace_id)


# --- internals ---------------------------------------------------------------------------------


def _insert(conn: sqlite3.Connection, expected: Expected) -> None:
    """A new trace's row, or the expectation of one whose parts came first; an expectation
    seen again (a duplicate) changes nothing."""
    conn.execute(
        f"INSERT INTO {TABLE} (trace_id, expected, received, absent, deadline_ns, state, why) "
        "VALUES (?, ?, '[]', ?, ?, ?, '') ON CONFLICT (trace_id) DO UPDATE SET "
        "expected = excluded.expected, absent = excluded.absent, "
        "deadline_ns = excluded.deadline_ns WHERE expected IS NULL",
        (
            expected.trace_id,
            _parts_json(expected.parts),
            _absent_json(expected.absent),
            expected.deadline_ns,
            PENDING,
        ),
    )


def _early(conn: sqlite3.Connection, trace_id: str) -> State | None:
    """The row of a trace whose part came before its expectation (expected unknown: it waits
    for the expectation, and no sweep makes it final)."""
    conn.execute(
        f"INSERT INTO {TABLE} (trace_id, expected, received, absent, deadline_ns, state, why) "
        "VALUES (?, NULL, '[]', '{}', 0, ?, '')",
        (trace_id, PENDING),
    )
    return _load(conn, trace_id)


def _update(conn: sqlite3.Connection, state: State, event: Event) -> bool:
    """Record received and absent parts; True when the row changed."""
    received = state.received | event.received
    absent = dict(state.absent)
    for part, why in event.absent.items():
        if part not in received:
            absent.setdefault(part, why)
    for part in received:
        absent.pop(part, None)
    if received == state.received and absent == dict(state.absent):
        return False
    conn.execute(
        f"UPDATE {TABLE} SET received = ?, absent = ? WHERE trace_id = ?",
        (_parts_json(received), _absent_json(absent), state.trace_id),
    )
    return True


def _settle(conn: sqlite3.Connection, state: State | None, *, timed_out: bool) -> bool:
    """Make `state` final if nothing is outstanding (or it `timed_out`); True when it is
    final now with an outcome to write."""
    if state is None or state.expected is None or (state.outstanding and not timed_out):
        return False
    whys = [
        f"{p.value}: {why}"
        for p, why in sorted(state.absent.items())
        if p in state.expected and p not in state.received
    ]
    late = sorted(p.value for p in state.outstanding)
    if late:
        whys.append(f"{TIMEOUT}: no {', '.join(late)} part by the deadline")
    outcome = INCOMPLETE if state.expected - state.received else WHOLE
    why = "; ".join(whys) if outcome == INCOMPLETE else ""
    conn.execute(
        f"UPDATE {TABLE} SET state = ?, why = ? WHERE trace_id = ?",
        (outcome, why, state.trace_id),
    )
    return True


def _write_outcome(conn: sqlite3.Connection, trace_id: str) -> None:
    """Fidelity (once, now that the trace is final) and the `assembly` attribute, on the
    trace row if there is one yet."""
    fidelity.refresh(conn, [trace_id])
    state = _load(conn, trace_id)
    row = conn.execute("SELECT attributes FROM traces WHERE trace_id = ?", (trace_id,)).fetchone()
    if state is None or row is None:
        return
    try:
        attributes = json.loads(row[0]) if row[0] else {}
    except ValueError:
        return  # a damaged row stays as it is (the report names it)
    if not isinstance(attributes, dict) or attributes.get(ATTRIBUTE) == state.record():
        return
    attributes[ATTRIBUTE] = state.record()
    conn.execute(
        "UPDATE traces SET attributes = ? WHERE trace_id = ?",
        (json.dumps(attributes, separators=(",", ":"), allow_nan=False), trace_id),
    )


def _overdue(conn: sqlite3.Connection, at_ns: int) -> list[str]:
    rows = conn.execute(
        f"SELECT trace_id FROM {TABLE} "
        "WHERE state = ? AND deadline_ns <= ? AND expected IS NOT NULL",
        (PENDING, at_ns),
    ).fetchall()
    return [r[0] for r in rows]


def _load(conn: sqlite3.Connection, trace_id: str) -> State | None:
    row = conn.execute(
        f"SELECT expected, received, absent, deadline_ns, state, why FROM {TABLE} "
        "WHERE trace_id = ?",
        (trace_id,),
    ).fetchone()
    if row is None:
        return None
    expected, received, absent, deadline_ns, state, why = row
    return State(
        trace_id,
        None if expected is None else _parts(expected),
        _parts(received),
        {Part(k): str(v) for k, v in json.loads(absent or "{}").items() if k in _NAMES},
        int(deadline_ns),
        state,
        why or "",
    )


_NAMES = frozenset(p.value for p in Part)


def _parts(text: str | None) -> frozenset[Part]:
    return frozenset(Part(p) for p in json.loads(text or "[]") if p in _NAMES)


def _parts_json(parts: Iterable[Part]) -> str:
    return json.dumps(sorted(p.value for p in parts))


def _absent_json(absent: Mapping[Part, str]) -> str:
    return json.dumps({p.value: why for p, why in sorted(absent.items())})
