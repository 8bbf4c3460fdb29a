"""Indented JSON text at the speed of the standard library's C encoder.

`json.dumps(obj, indent=...)` runs Python's pure-Python encoder (the C one only writes
unindented text before Python 3.13): a report of 0.9 M values takes about a second. `dumps`
writes the same text, byte for byte: containers that hold containers are walked here, and
each container of scalars (a table row, a list of numbers) is one call of the C encoder whose
item separator carries the newline and the indent of its depth.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

_Encoder = Callable[[Any], str]
_CONTAINERS = (dict, list, tuple)


def _is_container(value: Any) -> bool:
    return isinstance(value, _CONTAINERS)


def _holds_containers(items: Iterable[Any]) -> bool:
    """Whether any item is a container (`isinstance` mapped in C: no Python call per item,
    which a report's 0.2 M table cells would cost)."""
    return any(map(isinstance, items, repeat(_CONTAINERS)))


def _key(key: Any) -> str:
    """A dict key as `json` writes it (str, float, int, bool and None keys)."""
    if isinstance(key, str):
        text = key
    elif key is True:
        text = "true"
    elif key is False:
        text = "false"
    elif key is None:
        text = "null"
    elif isinstance(key, float):
        text = json.dumps(key, allow_nan=False)
    elif isinstance(key, int):
        text = int.__repr__(key)
    else:
        raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
    return json.dumps(text)


class _Writer:
    def __init__(self, indent: int, default: Callable[[Any], Any] | None) -> None:
        self.indent = indent
        self.default = default
        self.flat: dict[int, _Encoder] = {}

    def encoder(self, depth: int) -> _Encoder:
        """The C encoder for a container of scalars at `depth` (0: the top level)."""
        if depth not in self.flat:
            sep = ",\n" + " " * (self.indent * (depth + 1))
            self.flat[depth] = json.JSONEncoder(
                separators=(sep, ": "), default=self.default, allow_nan=False
            ).encode
        return self.flat[depth]

    def write(self, value: Any, depth: int, out: list[str]) -> None:
        if not _is_container(value):
            out.append(self.encoder(0)(value))
            return
        if not value:
            out.append("{}" if isinstance(value, dict) else "[]")
            return
        items = value.values() if isinstance(value, dict) else value
        inner = "\n" + " " * (self.indent * (depth + 1))
        close = "\n" + " " * (self.indent * depth)
        if not _holds_containers(items):
            text = self.encoder(depth)(value)
            out.append(text[0] + inner + text[1:-1] + close + text[-1])
            return
        if isinstance(value, dict):
            out.append("{")
            for n, (k, v) in enumerate(value.items()):
                out.append(("," if n else "") + inner + _key(k) + ": ")
                self.write(v, depth + 1, out)
            out.append(close + "}")
        else:
            out.append("[")
            for n, v in enumerate(value):
                out.append(("," if n else "") + inner)
                self.write(v, depth + 1, out)
            out.append(close + "]")


def dumps(obj: Any, indent: int = 1, default: Callable[[Any], Any] | None = None) -> str:
    """`json.dumps(obj, indent=indent, default=default, allow_nan=False)`, the same text."""
    out: list[str] = []
    _Writer(indent, default).write(obj, 0, out)
    return "".join(out)
