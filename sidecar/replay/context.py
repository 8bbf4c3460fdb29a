"""What a replay keeps in its worker process between jobs.

The profiling worker builds one `ReplayContext` from its `ReplayOptions` when it starts and
hands it to every job it runs (`sidecar.sampling.worker`): the options, the loaded runners and
what each runtime can use of the GPU stay with the process, not with a job.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.profiling.formats import ModelFormat
from sidecar.profiling.vocabulary import Runner
from sidecar.replay.device import CudaProbe, runtime_devices
from sidecar.replay.options import ReplayOptions
from sidecar.trace.store import TraceStore

log = logging.getLogger(__name__)


def close_runner(runner: Runner) -> None:
    """Let a runner that holds a model's own code end it (a Python model's `finalize`, as
    Triton calls it on unload); a failure is logged, never raised into the worker."""
    close = getattr(runner, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception:
        log.warning("closing the runner %s failed", getattr(runner, "name", runner), exc_info=True)


@dataclass(frozen=True, eq=False)
class ReplayContext:
    """The replay's state in one worker process. The fields are fixed; `runners` and
    `cuda_probes` fill up as jobs run, and `store` opens on first use."""

    options: ReplayOptions
    # what a runtime can use of CUDA here, asked once per format (tests give a fake)
    cuda_probe: Callable[[ModelFormat], CudaProbe] = runtime_devices
    # how the trace store is opened (tests give one that is full or broken)
    open_store: Callable[[Path], TraceStore] = TraceStore
    # loaded runners by model file, modification time and device; least recently used first
    runners: collections.OrderedDict[str, Runner] = field(default_factory=collections.OrderedDict)
    cuda_probes: dict[ModelFormat, CudaProbe] = field(default_factory=dict)

    @functools.cached_property
    def store(self) -> TraceStore:
        """The trace store the replay writes to, opened by the first job that stores."""
        return self.open_store(self.options.db_path)

    def keep(self, key: str, runner: Runner, size: int) -> None:
        """Keep `runner` as the most recently used; close the least recently used beyond
        `size`."""
        self.runners[key] = runner
        while len(self.runners) > size:
            _, evicted = self.runners.popitem(last=False)
            close_runner(evicted)

    def close(self) -> None:
        """Close every loaded runner (the worker stops)."""
        while self.runners:
            _, runner = self.runners.popitem(last=False)
            close_runner(runner)

    def probe(self, fmt: ModelFormat) -> CudaProbe:
        """What runtime `fmt` can use of CUDA in this process (asked once)."""
        if fmt not in self.cuda_probes:
            self.cuda_probes[fmt] = self.cuda_probe(fmt)
        return self.cuda_probes[fmt]
