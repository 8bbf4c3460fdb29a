"""The batches the backend executed while a sampled request was in flight.

When a request is sampled (its headers), its window opens: the backend's execution counters
are read (`Backend.statistics`: Triton's `ModelStatistics`), on this module's threads over the
sidecar's own channel to the backend, never on the relay's path. When the request's span is
stored (its response has left), they are read again. The difference for the request's model is
what the server executed in between: how many requests it computed, in how many executions,
of which batch sizes (with dynamic batching a request is computed inside a larger batch). It
goes on the proxy's request span as attribute `server_batch_window`.

Both reads race the request, so a window is checked before it is stored. The first read must
not count the request already (the window would hold the requests after it): it did not if it
completed before the server's response reached the relay, or if the model's latest completed
request it knows of (`last_inference`: when Triton finished it, whole ms on the host's clock)
finished in an earlier millisecond than the relay read this request's headers. The difference
must count at least one computed request of the model (the server can count an execution only
after the response left, so the second read is retried a few times, `SETTLE_S` apart). A window
that fails either check is stored as `{"unobserved": reason}`, never as numbers. The channel is
opened and the message classes loaded at start, so that the first window's read is not late. A
window holds every execution of the model in it, the sampled request's and those of concurrent
requests: it is what the server was doing, not a per-request attribution.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc

from sidecar.backends.base import StatisticsReader
from sidecar.backends.triton_statistics import ModelCounts
from sidecar.trace import schema

log = logging.getLogger(__name__)

ATTRIBUTE = schema.SERVER_BATCH_WINDOW  # the request span's attribute
OPEN_LIMIT = 64  # windows open at once; the oldest is given up beyond it
READ_TIMEOUT_S = 1.0
SETTLE_S = 0.02  # between retries of the second read
RETRIES = 3

Counts = Mapping[str, ModelCounts]
Read = tuple[Counts | str, int]  # the counters (or why not), and when the read completed


def window(before: Counts, after: Counts, model: str) -> dict[str, Any]:
    """What the server executed of `model` between two reads, or why that is not known."""
    if model not in after:
        return {schema.WINDOW_UNOBSERVED: f"the backend's statistics do not list model {model!r}"}
    old, new = before.get(model, ModelCounts()), after[model]
    inferences = new.inferences - old.inferences
    if inferences <= 0:
        return {
            schema.WINDOW_UNOBSERVED: "no computed request of the model was counted between the "
            "two reads (the first read came after the server computed the request, or it failed)"
        }
    sizes = {
        str(size): count - old.batches.get(size, 0)
        for size, count in sorted(new.batches.items())
        if count - old.batches.get(size, 0) > 0
    }
    return {
        schema.WINDOW_INFERENCES: inferences,
        schema.WINDOW_EXECUTIONS: new.executions - old.executions,
        schema.WINDOW_BATCH_SIZES: sizes,
    }


class BatchWindows:
    """Open windows by trace id; see the module docstring."""

    def __init__(
        self,
        target: str,
        read: StatisticsReader,
        *,
        timeout_s: float = READ_TIMEOUT_S,
        settle_s: float = SETTLE_S,
        limit: int = OPEN_LIMIT,
    ) -> None:
        self._channel = grpc.insecure_channel(target)
        self._read_counts = read
        self._timeout_s = timeout_s
        self._settle_s = settle_s
        self._limit = limit
        # first reads and second reads on threads of their own: a second read does not wait
        # behind the first reads of later requests (that would widen its window)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xsp-batch-window-open")
        self._closing = ThreadPoolExecutor(1, thread_name_prefix="xsp-batch-window-close")
        self._open: OrderedDict[str, Future[Read]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._pool.submit(self._read)  # connect, and load the messages, before the first window

    def open(self, trace_id: str) -> None:
        """Read the counters now, for the window of `trace_id` (the relay's thread: cheap)."""
        with self._lock:
            if self._closed:
                return
            while len(self._open) >= self._limit:
                self._open.popitem(last=False)
            self._open[trace_id] = self._pool.submit(self._read)

    def close(
        self,
        trace_id: str,
        model: str,
        answered_ns: int,
        then: Callable[[dict[str, Any]], object],
        *,
        started_ns: int = 0,
    ) -> bool:
        """Read again and hand the window of `trace_id` to `then` (on a window thread);
        `answered_ns`: when the server's response reached the relay, `started_ns`: when the
        relay read the request's headers (Unix ns; 0: unknown). False when no window of
        `trace_id` is open (`then` is not called)."""
        with self._lock:
            first = self._open.pop(trace_id, None)
            if first is None or self._closed:
                return False
            times = (started_ns, answered_ns)
            self._closing.submit(self._finish, first, model, times, then)
        return True

    def stop(self) -> None:
        """Finish the windows being closed (their spans are handed on), give up the others."""
        with self._lock:
            self._closed = True
            self._open.clear()
        self._closing.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._channel.close()

    def _read(self) -> Read:
        try:
            counts: Counts | str = self._read_counts(self._channel, self._timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            counts = f"the backend's statistics could not be read ({getattr(code, 'name', exc)})"
        except Exception as exc:  # a malformed answer: the window is lost, nothing else
            log.debug("statistics read failed", exc_info=True)
            counts = f"the backend's statistics could not be read ({type(exc).__name__})"
        return counts, time.time_ns()

    def _finish(
        self,
        first: Future[Read],
        model: str,
        times: tuple[int, int],
        then: Callable[[dict[str, Any]], object],
    ) -> None:
        try:
            then(self._measure(first, model, *times))
        except Exception:
            log.exception("could not hand a batch window on")

    def _measure(
        self, first: Future[Read], model: str, started_ns: int, answered_ns: int
    ) -> dict[str, Any]:
        before, read_ns = first.result()
        if isinstance(before, str):
            return {schema.WINDOW_UNOBSERVED: before}
        known = before.get(model)
        earlier = known is not None and known.last_inference_ms < started_ns // 1_000_000
        if read_ns > answered_ns and not earlier:
            late_ms = (read_ns - answered_ns) / 1e6
            return {
                schema.WINDOW_UNOBSERVED: f"the first read completed {late_ms:.2f} ms after the "
                "server's response reached the relay (it may already count the request)"
            }
        result: dict[str, Any] = {}
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(self._settle_s)
            after, done_ns = self._read()
            if isinstance(after, str):
                return {schema.WINDOW_UNOBSERVED: after}
            result = window(before, after, model)
            if schema.WINDOW_UNOBSERVED not in result:
                # how long the window stayed open after the response: executions in that
                # time came after the request (the later its end, the wider the window)
                result[schema.WINDOW_CLOSED_AFTER_RESPONSE_MS] = round(
                    (done_ns - answered_ns) / 1e6, 3
                )
                return result
        return result
