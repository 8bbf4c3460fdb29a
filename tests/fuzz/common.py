"""What every fuzz target shares: reading a fuzz input's fields, and running under atheris.

An input is a few fixed-size fields at the front (options, where to cut the bytes into
chunks) and the bytes to parse. Fields are read leniently (zeros past the end, lengths clamped
to what is left), so every input is valid and mutations of a real exchange stay near it. The
corpus builder (`tests/fuzz/corpus_build.py`) writes inputs with the `Writer` twin.

A target module defines `check(data: bytes) -> None`, which raises AssertionError when the C
result and the Python reference differ, and imports what it checks inside
`instrumented(__name__ == "__main__")`: under atheris that gives coverage feedback from the
Python code it runs (see docs/testing.md for what that covers of the C).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).parent / "corpus"
MAX_CUTS = 6


class Reader:
    """Fields from the front of a fuzz input, then the rest."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def uint(self, size: int) -> int:
        value = int.from_bytes(self.data[self.pos : self.pos + size], "big")
        self.pos += size
        return value

    def take(self, size: int) -> bytes:
        out = self.data[self.pos : self.pos + size]
        self.pos += size
        return out

    def cuts(self) -> list[int]:
        """A count (up to MAX_CUTS) and that many 2-byte offsets."""
        return [self.uint(2) for _ in range(self.uint(1) % (MAX_CUTS + 1))]

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out

    @property
    def done(self) -> bool:
        return self.pos >= len(self.data)


class Writer:
    """The `Reader`'s twin: builds an input field by field."""

    def __init__(self) -> None:
        self.out = bytearray()

    def uint(self, size: int, value: int) -> Writer:
        self.out += value.to_bytes(size, "big")
        return self

    def cuts(self, cuts: list[int]) -> Writer:
        self.uint(1, len(cuts))
        for cut in cuts:
            self.uint(2, cut)
        return self

    def raw(self, data: bytes) -> Writer:
        self.out += data
        return self

    def bytes(self) -> bytes:
        return bytes(self.out)


@contextlib.contextmanager
def instrumented(fuzzing: bool) -> Iterator[None]:
    """Imports made inside are instrumented for coverage when `fuzzing` (the target runs as
    `python -m tests.fuzz.fuzz_...`: `__name__ == "__main__"`); a no-op otherwise."""
    if not fuzzing:
        yield
        return
    import atheris

    with atheris.instrument_imports(include=["sidecar", "hpack"]):
        yield


def outcome(fn: Callable[[], Any]) -> Any:
    """What `fn` returns, or the exception it raised (as its type and text, comparable)."""
    try:
        return ("returned", fn())
    except Exception as exc:  # both sides must fail alike; an AssertionError is a finding
        if isinstance(exc, AssertionError):
            raise
        return ("raised", type(exc).__name__, str(exc))


def main(check: Callable[[bytes], None]) -> None:
    """Run `check` under atheris with libFuzzer's command line (corpus dirs, -max_total_time)."""
    import atheris

    atheris.Setup(sys.argv, check)
    atheris.Fuzz()


def corpus_inputs(target: str) -> list[Path]:
    return sorted(p for p in (CORPUS / target).iterdir() if p.is_file())
