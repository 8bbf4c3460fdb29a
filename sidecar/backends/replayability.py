"""Whether a replay can run a model: decided from its repository before a sample is queued.

A model is replayable when its backend's repository lookup (`Repository.find`) resolves a
file a replay runner loads (ONNX, TorchScript, SavedModel; a Python-backend model whose
version folder holds one of them, or its own `model.py`; an ensemble, by its `config.pbtxt`).
A model the lookup cannot resolve for that reason (`UnsupportedModelFormatError`: a
Python-backend model with only its `model.py`, or an ensemble with such a step, under
`--replay-python-models off`, TensorRT, an unknown backend) is not: its
sampled requests become live-only traces (the relay's span, the backend's spans, the batch
window; `status=live_only`, `replay` says why) and no job goes to the profiling worker. Other
lookup failures (a `config.pbtxt` that does not parse, a missing version folder) are left to
the replay, which records them as a failed profile: they are faults to fix, not a kind of model.

A new replayer plugs in by making the lookup resolve what it runs, as the ones running a
Python-backend model's own `model.py` and an ensemble's graph did: the decision flips to
replayable with no change here.

The relay's process asks `ReplayabilityCache.of` once per sample (the budget bounds how
often); the answer is kept per model for `ttl_s`, so a model added or changed in the
repository is seen within that time. `warm` asks for the repository's models beforehand, on
another thread, so that the relay's thread finds the configuration parser loaded and the
answers kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOT_REPLAYABLE = "not_replayable"  # the prefix of a live-only trace's `replay` attribute

Finder = Callable[[Path, str, str | int | None], Any]  # `Repository.find`


@dataclass(frozen=True, slots=True)
class Replayability:
    """A model's answer: `replayable`, or `reason` says why not."""

    replayable: bool
    reason: str = ""

    @property
    def attribute(self) -> str:
        """A live-only trace's `replay` attribute: `not_replayable: <reason>`."""
        return f"{NOT_REPLAYABLE}: {self.reason}"


REPLAYABLE = Replayability(True)


def replayability(find: Finder, repository: Path, model: str) -> Replayability:
    """Ask the backend's lookup `find` whether a replay runner can load `model`."""
    from sidecar.backends.model_repository import (
        ModelRepositoryError,
        UnsupportedModelFormatError,
    )

    try:
        find(repository, model, None)
    except UnsupportedModelFormatError as exc:
        return Replayability(False, str(exc))
    except (ModelRepositoryError, OSError):
        return REPLAYABLE  # the replay records the fault (module docstring)
    return REPLAYABLE


class ReplayabilityCache:
    """`replayability` per model, asked again once an answer is `ttl_s` old."""

    def __init__(
        self,
        find: Finder,
        repository: Path,
        *,
        ttl_s: float = 10.0,
        max_models: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._find = find
        self._repository = repository
        self._ttl_s = ttl_s
        self._max_models = max_models
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[float, Replayability]] = {}

    def warm(self, limit: int = 256) -> None:
        """Ask for (up to `limit`) model folders of the repository now."""
        try:
            folders = sorted(p.name for p in self._repository.iterdir() if p.is_dir())
        except OSError:
            return
        for model in folders[:limit]:
            self.of(model)

    def of(self, model: str) -> Replayability:
        now = self._clock()
        with self._lock:
            kept = self._answers.get(model)
        if kept is not None and now - kept[0] < self._ttl_s:
            return kept[1]
        answer = replayability(self._find, self._repository, model)
        with self._lock:
            if len(self._answers) >= self._max_models:  # names come from requests: bounded
                self._answers.clear()
            self._answers[model] = (now, answer)
        return answer
