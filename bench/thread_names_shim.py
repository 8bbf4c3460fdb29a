"""Run `xsp-sidecar serve` with each Python thread's name given to its OS thread.

Python 3.11 leaves every thread's `/proc/<pid>/task/<tid>/comm` at the process's name, so a
per-thread CPU reading cannot tell the writer from the worker's supervisor. This sets the
kernel's name (`prctl(PR_SET_NAME)`, first 15 bytes) of every thread `threading` starts,
thread pools included, and of the main thread ("main"), then runs the CLI unchanged. Threads
started by native code (gRPC's core) keep the names their library gives them.

    python bench/thread_names_shim.py serve --backend HOST:PORT ...
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)
_bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def name_os_thread(name: str) -> None:
    """Give the calling thread's kernel name `name` (cut to the 15 bytes the kernel keeps)."""
    _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _named_bootstrap(self: threading.Thread, *args: Any) -> None:
    name_os_thread(self.name)
    _bootstrap_inner(self, *args)


threading.Thread._bootstrap_inner = _named_bootstrap  # type: ignore[attr-defined]

if __name__ == "__main__":
    from sidecar.cli import main

    name_os_thread("main")
    sys.exit(main(sys.argv[1:]))
