"""Parsers of `serve` settings: `parse(value, where) -> typed value`, or a `ConfigError`.

`value` comes from a flag, an `XSP_*` variable (text) or the TOML file (text, number or bool);
`where` names the setting and its source for the message, e.g. `--metrics-port`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from sidecar.backends import BACKENDS
from sidecar.profiling.devices import device_name
from sidecar.profiling.levels import parse_levels
from sidecar.trace.spans import Level


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent."""


def _convert(value: Any, setting: str, kind: type[int] | type[float], expected: str) -> Any:
    """`kind(value)`, or a `ConfigError` saying what was `expected`."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{setting}: expected {expected}, got {value!r}") from None


def port(value: Any, setting: str, allow_zero: bool = False) -> int:
    number: int = _convert(value, setting, int, "a port number")
    low = 0 if allow_zero else 1
    if not low <= number <= 65535:
        raise ConfigError(f"{setting}: port {number} is outside {low}..65535")
    return number


def any_port(value: Any, setting: str) -> int:
    """A port number; 0 lets the system choose one (or, for some settings, turns it off)."""
    return port(value, setting, allow_zero=True)


def _at_least(value: Any, setting: str, low: int, bound: str) -> int:
    number: int = _convert(value, setting, int, "a whole number")
    if number < low:
        raise ConfigError(f"{setting}: must be {bound}, got {number}")
    return number


def positive_int(value: Any, setting: str) -> int:
    return _at_least(value, setting, 1, "at least 1")


def whole(value: Any, setting: str) -> int:
    return _at_least(value, setting, 0, "zero or more")


def _not_negative(value: Any, setting: str, expected: str, bound: str) -> float:
    number: float = _convert(value, setting, float, expected)
    if not number >= 0:
        raise ConfigError(f"{setting}: must be {bound}, got {value!r}")
    return number


def seconds(value: Any, setting: str) -> float:
    return _not_negative(value, setting, "a number of seconds", "zero or more seconds")


def non_negative(value: Any, setting: str) -> float:
    return _not_negative(value, setting, "a number", "zero or more")


def finite_non_negative(value: Any, setting: str) -> float:
    number = non_negative(value, setting)
    if number == float("inf"):
        raise ConfigError(f"{setting}: must be a finite number, got {number}")
    return number


def fraction(value: Any, setting: str, allow_zero: bool = True) -> float:
    number: float = _convert(value, setting, float, "a number between 0 and 1")
    if not (0.0 <= number <= 1.0) or (number == 0.0 and not allow_zero):
        low = "0" if allow_zero else "more than 0"
        raise ConfigError(f"{setting}: must be from {low} to 1, got {value!r}")
    return number


def duty_cycle(value: Any, setting: str) -> float:
    """A fraction above 0 and at least 0.001 (a smaller one closes the gate for days)."""
    number = fraction(value, setting, allow_zero=False)
    if number < 0.001:
        raise ConfigError(f"{setting}: must be at least 0.001, got {number:g}")
    return number


def text(value: Any, setting: str) -> str:
    return str(value)


def path(value: Any, setting: str) -> Path:
    return Path(str(value)).expanduser()


def protocol(value: Any, setting: str) -> str:
    """The name of a registered backend (`sidecar.backends`)."""
    name = str(value).lower()
    if name not in BACKENDS:
        raise ConfigError(f"{setting}: expected one of {', '.join(BACKENDS)}, got {value!r}")
    return name


def boolean(value: Any, setting: str) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{setting}: expected true or false, got {value!r}")


def levels(value: Any, setting: str) -> tuple[Level, ...]:
    """`M,L,K` or `model,layer,kernel` in any case, through the one level parser."""
    try:
        return parse_levels(str(value))
    except ValueError as exc:
        raise ConfigError(f"{setting}: {exc}; got {value!r}") from None


def replay_device(value: Any, setting: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N`, in canonical form (`cuda` is `cuda:0`)."""
    try:
        return device_name(str(value), allow_auto=True)
    except ValueError as exc:
        raise ConfigError(f"{setting}: {exc}") from None


def sample_slow(value: Any, setting: str) -> float | Literal["off", "p99"]:
    """`off`, `p99`, or a latency in milliseconds (`250`, `250ms`, `12.5ms`) above 0."""
    word = str(value).strip().lower()
    if word == "off":
        return "off"
    if word == "p99":
        return "p99"
    number = word.removesuffix("ms").strip()
    try:
        ms = float(number)
    except ValueError:
        ms = math.nan
    if isinstance(value, bool) or not 0 < ms < math.inf:
        raise ConfigError(
            f"{setting}: expected off, p99 or a latency in milliseconds above 0 "
            f"(e.g. 250 or 250ms), got {value!r}"
        )
    return ms


def header(value: Any, setting: str) -> str:
    key = str(value).strip().lower()
    if key and not all(c.isalnum() or c in "-_." for c in key):
        raise ConfigError(f"{setting}: {value!r} is not a valid gRPC metadata key")
    return key
