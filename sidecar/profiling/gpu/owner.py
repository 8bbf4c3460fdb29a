"""One CUPTI client per process.

Measured on an H100: after `torch.profiler` (Kineto, itself a CUPTI client) has run once in
a process, the records of a later `CuptiTracer` come back on a different clock (a 27.4 ms
kernel window inside a 13.5 ms host wall) and nothing fails. So the first CUPTI client a
process uses owns CUPTI for the rest of its life; another one raises `CuptiOwnerError`.
The profiling worker and `profile` therefore use one kind of K-level profiler per process,
and anything that must compare with torch.profiler does so in a subprocess.

Measured on an H100 too (`bench/gpu_after_cupti.py`, fresh processes against a control):
once CUPTI has recorded in a process, its forwards stay 1.2-2.1x slower at launch-bound batch
sizes after every activity kind is disabled. The profiling worker replaces its process after
such a job; an experiment whose M runs where a CUPTI client already ran (`profile` over
several batch sizes with K on a GPU) says so in its trace attribute `MODEL_LEVEL_AFTER_CUPTI`.
"""

from __future__ import annotations

import threading

from sidecar.profiling.vocabulary import LevelNotSupportedError

TORCH_PROFILER = "torch.profiler"
CUPTI_TRACER = "CuptiTracer"
ORT_CUDA_PROFILER = "ONNX Runtime's CUDA profiler"  # builds with --enable_cuda_profiling
# trace attribute: the CUPTI client that had run in the process before this experiment's M
MODEL_LEVEL_AFTER_CUPTI = "model_level_after_cupti"


class CuptiOwnerError(LevelNotSupportedError):
    """A second CUPTI client was asked for in a process that already has one."""


class CuptiOwner:
    """Who owns CUPTI in this process; the first claim sticks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: str | None = None

    def check(self, client: str) -> None:
        """Raise if a client other than `client` already used CUPTI in this process."""
        with self._lock:
            self._check(client)

    def claim(self, client: str) -> None:
        """Record `client` as the owner, or raise if another client already used CUPTI."""
        with self._lock:
            self._check(client)
            self.owner = client

    def _check(self, client: str) -> None:
        if self.owner is not None and self.owner != client:
            raise CuptiOwnerError(
                f"{client} cannot trace in this process: {self.owner} already used CUPTI "
                "here, and a second CUPTI client gets records on a wrong clock (measured "
                "on an H100). Run it in a fresh process (e.g. one `xsp-sidecar profile` "
                "per profiler)."
            )


PROCESS_OWNER = CuptiOwner()
