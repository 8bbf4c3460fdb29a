"""The CPU accounting `bench/proxy_overhead.py` uses for the bare relay it compares against.

socat forks a process per connection; its CPU must be counted whether a child is still
running or already reaped when the bench reads it. Real processes, real /proc.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from proxy_overhead import await_listening, forking_relay_cpu_seconds

from tests.harness.process import free_port

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"

FORKING_PARENT = f"""
import os, sys, time
pid = os.fork()
if pid == 0:
    exec({BURN.format(s=0.4)!r})
    os._exit(0)
print("forked", flush=True)
sys.stdin.readline()          # the test reads the CPU while the child runs or has ended
os.waitpid(pid, 0)            # reaped: its CPU moves into this process's cutime
print("reaped", flush=True)
sys.stdin.readline()
"""


def test_a_forked_childs_cpu_is_counted_while_running_and_after_it_is_reaped() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING_PARENT],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "forked"
        start = forking_relay_cpu_seconds(proc.pid)
        deadline = time.monotonic() + 10
        running = start
        while running <= start and time.monotonic() < deadline:
            time.sleep(0.05)
            running = forking_relay_cpu_seconds(proc.pid)
        assert running > start  # the running child's CPU counts before it is reaped
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "reaped"
        reaped = forking_relay_cpu_seconds(proc.pid)
        assert reaped - start >= 0.3  # the child's 0.4 s, now in the parent's cutime
        assert reaped >= running
    finally:
        proc.kill()
        proc.wait(10)


def test_await_listening_reports_a_process_that_exits_instead_of_listening() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="the relay exited with code 3"):
        await_listening(proc, free_port(), "the relay", timeout=10)
