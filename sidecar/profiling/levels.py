"""Level names: `M,L,K` or `model,layer,kernel` (any case) <-> `Level`s in depth order.

The one parser of level lists: `serve --levels`, `profile --levels` and the replay all use it.
"""

from __future__ import annotations

from sidecar.trace.spans import LEVEL_CODES, REPLAY_LEVELS, Level


def parse_levels(text: str) -> tuple[Level, ...]:
    """`"M,L"` -> (Level.MODEL, Level.LAYER); raises ValueError naming the bad entry."""
    out: set[Level] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        level = LEVEL_CODES.get(part.upper())
        if level is None:
            try:
                level = Level(part.lower())
            except ValueError:
                level = None
        if level is None or level not in REPLAY_LEVELS:
            raise ValueError(f"unknown level {part!r}: use M (model), L (layer), K (kernel)")
        out.add(level)
    if not out:
        raise ValueError("no levels given: use e.g. M,L,K")
    return tuple(lv for lv in REPLAY_LEVELS if lv in out)


def format_levels(levels: tuple[Level, ...]) -> str:
    """(Level.MODEL, Level.LAYER) -> `"M,L"`, the form `parse_levels` reads back."""
    codes = {level: code for code, level in LEVEL_CODES.items()}
    return ",".join(codes[level] for level in levels)
