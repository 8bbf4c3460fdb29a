"""Device names the profiler accepts: `cpu`, `cuda` (= `cuda:0`) and `cuda:N`, plus `auto`
where a setting lets the model decide (`serve --replay-device`), and the CPU's own name.
No runtime import."""

from __future__ import annotations

import platform
import re

AUTO = "auto"
CPU = "cpu"
_NAME = re.compile(r"^(cpu|cuda|cuda:\d+)$")


def device_name(text: str, *, allow_auto: bool = False) -> str:
    """`text` in canonical form (`CUDA` -> `cuda:0`, `cuda:01` -> `cuda:1`); ValueError if
    it names no device."""
    name = str(text).strip().lower()
    if allow_auto and name == AUTO:
        return AUTO
    if not _NAME.match(name):
        choices = "auto, cpu, cuda or cuda:N" if allow_auto else "cpu, cuda or cuda:N"
        raise ValueError(f"unknown device {text!r}: use {choices}")
    if name == CPU:
        return CPU
    return f"cuda:{int(name[5:]) if ':' in name else 0}"


def cuda_index(name: str) -> int | None:
    """The CUDA device index of a device name, None for the CPU."""
    canonical = device_name(name)
    return None if canonical == CPU else int(canonical.split(":")[1])


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (or the platform's machine string)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} (CPU)"
    except OSError:
        pass
    return f"{platform.machine()} (CPU)"
