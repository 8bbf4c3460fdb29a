"""Readable kernel names: the full demangled C++ name, and a short form for text and HTML.

`cxxfilt` (abi::__cxa_demangle) does the work; where it is missing or fails, the `c++filt`
binary is tried, and where both are missing the mangled name is kept as it is.
"""

from __future__ import annotations

import functools
import shutil
import subprocess


@functools.lru_cache(maxsize=4096)
def demangle(name: str) -> str:
    """`_ZN2at6native...` -> `void at::native::...(...)`; other names are returned as given."""
    if not name.startswith("_Z"):
        return name
    try:
        import cxxfilt

        return str(cxxfilt.demangle(name))
    except Exception:  # not installed, or a name libstdc++ cannot demangle
        pass
    tool = shutil.which("c++filt")
    if tool is None:
        return name
    try:
        out = subprocess.run([tool, name], capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return name
    return out.stdout.strip() or name


_ANON = "(anonymous namespace)"  # a namespace, not a parameter list


def short_name(name: str, width: int = 80) -> str:
    """`void at::native::vectorized_elementwise_kernel<4, ...>(...)` ->
    `at::native::vectorized_elementwise_kernel<…>`: no return type, arguments or template
    arguments, at most `width` characters."""
    full = demangle(name)
    head = _strip_enclosed(full.replace(_ANON, "\0"), "(", ")")
    head = _strip_enclosed(head, "<", ">", keep_marker="<…>").replace("\0", _ANON)
    if head.startswith("void "):
        head = head[len("void ") :]
    head = head.strip() or full
    return head if len(head) <= width else head[: width - 1] + "…"


def _strip_enclosed(text: str, open_: str, close: str, keep_marker: str = "") -> str:
    """Drop every top-level `open_ ... close` group (nested groups included)."""
    out: list[str] = []
    depth = 0
    for ch in text:
        if ch == open_:
            if depth == 0 and keep_marker:
                out.append(keep_marker)
            depth += 1
        elif ch == close and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def base_name(name: str) -> str:
    """The kernel's own identifier (last `::` component, no templates or arguments): what
    CUPTI's and Nsight Compute's spellings of one kernel have in common."""
    head = _strip_enclosed(_strip_enclosed(demangle(name), "(", ")"), "<", ">")
    head = head.split()[-1] if head.split() else head
    return head.rsplit("::", 1)[-1]
