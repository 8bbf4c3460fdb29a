"""Faults to hand the relay's C code: objects whose attributes, comparisons, truth or numbers
raise an `Injected` error, so a test can tell whether the C passed that error on (the
framewalk's and the HTTP pump's fault tests share them)."""

from __future__ import annotations

from typing import Any

from sidecar.proxy.frames import ScanError

RAISES = object()  # an attribute that raises when read
READ_ONLY = object()  # an attribute read as it is, that raises when written


class Injected(ScanError):
    """What a fault raises: a `ScanError`, so its reason ("injected") is the one a failed
    observation reports if the walk passes the fault's own exception on."""

    def __init__(self, detail: str) -> None:
        super().__init__("injected", detail)


class Faulty:
    """Every attribute of `inner`, but those in `faults`: raised (RAISES), read-only
    (READ_ONLY: its write raises) or that value; other writes go to `inner`."""

    def __init__(self, inner: Any, faults: dict[str, Any]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_faults", faults)

    def __getattr__(self, name: str) -> Any:
        fault = self._faults.get(name, READ_ONLY)
        if fault is RAISES:
            raise Injected(f"{name} cannot be read")
        return getattr(self._inner, name) if fault is READ_ONLY else fault

    def __setattr__(self, name: str, value: Any) -> None:
        if self._faults.get(name) is READ_ONLY:
            raise Injected(f"{name} cannot be written")
        setattr(self._inner, name, value)


class PropertyFault:
    """Makes one attribute of an object raise, by giving it a subclass with that property
    (with `once`, only its next read: the relay's own clean-up reads it too)."""

    def __init__(self, name: str, once: bool = False) -> None:
        self.name, self.once = name, once

    def __call__(self, obj: Any) -> None:
        value, reads = obj.__dict__.get(self.name), [0]

        def broken(_: Any) -> Any:
            reads[0] += 1
            if self.once and reads[0] > 1:
                return value
            raise Injected(f"{self.name} cannot be read")

        obj.__class__ = type("Broken", (type(obj),), {self.name: property(broken)})


class NoBool:
    """A false value whose truth raises the injected fault the first time it is asked (so
    the sink's Python, asking after the walk, would not raise it again)."""

    def __init__(self) -> None:
        self.asked = False

    def __bool__(self) -> bool:
        if not self.asked:
            self.asked = True
            raise Injected("no truth")
        return False


class Collides:
    """Hashed as `twin`; once `Collides.armed`, its next comparison raises the injected
    fault and disarms it (the sink's Python, comparing after the walk, is not refused again).
    Arm it after the table around it is built: building one compares too."""

    armed = False

    def __init__(self, twin: object) -> None:
        self.twin = twin

    def __hash__(self) -> int:
        return hash(self.twin)

    def __eq__(self, other: object) -> bool:
        if Collides.armed:
            Collides.armed = False
            raise Injected("no comparison")
        return False


class RaisingCounts(list):  # type: ignore[type-arg]
    """Counters whose count raises the injected fault."""

    def __setitem__(self, key: Any, value: Any) -> None:
        raise Injected("no count")


class NoFloat:
    """A number whose float() raises the injected fault."""

    def __float__(self) -> float:
        raise Injected("no float")


def raising_rand() -> float:
    raise Injected("no draw")
