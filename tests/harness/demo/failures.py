"""What the demo says when it cannot go on: one line with what went wrong and what to do, on
stderr, and a non-zero exit; no traceback for a failure it knows."""

from __future__ import annotations

import re
import shlex
import subprocess

from tests.harness.process import StartError
from tests.harness.triton.environment import TritonSetupError

PORT_TAKEN = re.compile(r"in use|EADDRINUSE", re.IGNORECASE)


class DemoError(Exception):
    """The demo cannot run here; the message says why and what to do."""


def explain(exc: BaseException) -> str | None:
    """One line for a failure the demo knows (a server that does not start, a port taken, a
    Triton environment not set up, a missing extra, a step that failed with its output above);
    None for anything else."""
    if isinstance(exc, DemoError):
        return str(exc)
    if isinstance(exc, StartError):
        reason = f": {exc.reason}" if exc.reason else ""
        if PORT_TAKEN.search(exc.reason):
            todo = "another process took a port the demo had picked; run the demo again"
        else:
            todo = f"its log: {exc.log_path}" if exc.log_path else "run the demo again"
        return f"{exc.summary}{reason}; {todo}"
    if isinstance(exc, TritonSetupError):  # the environment (start-up failures are StartErrors)
        first = str(exc).splitlines()[0].rstrip(":")
        return first if "setup.sh" in first else f"{first}; `bash scripts/setup.sh` prepares it"
    if isinstance(exc, subprocess.CalledProcessError):
        command = shlex.join(str(word) for word in exc.cmd)
        return f"`{command}` exited with code {exc.returncode} (its output is above)"
    return None


def tensorflow_missing() -> DemoError | None:
    """The error to stop the TF-Serving demo with when TensorFlow or tensorflow-serving-api
    cannot be imported here, else None (and both are imported)."""
    try:
        import tensorflow  # noqa: F401
        import tensorflow_serving.apis.predict_pb2  # noqa: F401
    except ImportError as exc:
        return DemoError(
            f"the TF-Serving demo needs TensorFlow and tensorflow-serving-api ({exc}); install "
            "the extra with `pip install -e '.[tensorflow]'` (`bash scripts/setup.sh` does)"
        )
    return None
