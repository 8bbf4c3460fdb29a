"""The requests open on one relayed HTTP/1.1 connection, in order, and how each ends.

Responses answer requests in the order they came (pipelining included), so one FIFO holds the
open calls: a request enters it when its header block is forwarded, and the final response
(not a 1xx) that ends leaves with the call at its head. Each ended call is counted in
`ProxyMetrics.http` under bounded method/model labels and told to the observer (I3 of issue
42: `RequestStart` at the headers, `on_request_body` with the de-chunked body, `StreamEnd` at
the response's end, or a `QuietEnd` counted here instead). Observer exceptions are caught,
logged and counted in `xsp_observer_errors_total{hook}`.

Where the hook has a `quick` (`streams.QuickDecisions`: sampling on, `sample_slow` off), the
book answers a request the hook would not pick itself, as the gRPC relay's C walk does: a
replayable method whose block lacks the force header flips the hook's own coin, and an
unpicked one (or a method never replayed) gets the hook's `QuietEnd` with no `RequestStart`
made (no header fields split out) and no call into the hook. A picked coin goes to the hook
with `coin_picked` set, so the hook does not flip again.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from sidecar.proxy.http.fields import header_fields
from sidecar.proxy.http.status import MAX_ERROR_TEXT, error_text, grpc_code
from sidecar.proxy.metrics import ProxyMetrics
from sidecar.proxy.streams import (
    ConnectionObserver,
    HeaderDecision,
    QuietEnd,
    RequestStart,
    StreamEnd,
)

log = logging.getLogger(__name__)

_record = tuple.__new__  # a NamedTuple from a tuple of every field (see streams.py)


class Call:
    """One request of a connection, from its header block to its response's end."""

    __slots__ = (
        "body", "capture_limit", "error", "head", "method", "model", "path", "quiet",
        "request_bytes", "request_end", "response_bytes", "response_start", "sampled", "sid",
        "start", "start_ns", "status",
    )  # fmt: skip

    def __init__(self, sid: int, method: str, model: str | None, head: bool) -> None:
        self.sid = sid
        self.method = method  # bounded label
        self.model = model  # as the route read it (unbounded)
        self.head = head  # a HEAD request: its response has no body
        self.path = ""  # the target as text, once the observer was asked
        self.start = time.perf_counter()
        self.start_ns = 0
        self.request_bytes = 0
        self.response_bytes = 0
        self.request_end = 0.0  # perf_counter at the request's end forwarded (0: not yet)
        self.response_start = 0.0  # perf_counter at the response's header block (0: not yet)
        self.status = 0  # the final response's status (0: none yet)
        self.error: bytearray | None = None  # an error response's body start
        self.body: bytearray | None = None  # the request body, while captured
        self.capture_limit = 0
        self.sampled = False
        self.quiet: QuietEnd | None = None


def extra_header_bytes(fields: object) -> bytes:
    """`Name: value\\r\\n` lines of an observer's extra header fields (ValueError: invalid)."""
    out = []
    for name, value in fields:  # type: ignore[attr-defined]
        line = f"{name}: {value}\r\n"
        if any(c in line[:-2] for c in "\r\n\0") or not name or ":" in name:
            raise ValueError(f"invalid header field {name!r}")
        out.append(line.encode("latin-1"))
    return b"".join(out)


class CallBook:
    """The open calls of one connection (see the module docstring)."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        observer: ConnectionObserver | None,
        connection_id: int,
    ) -> None:
        self.metrics = metrics
        self.observer = observer
        self.connection_id = connection_id
        self.open: deque[Call] = deque()
        self.count = 0  # requests started on this connection (the next one's stream id - 1)
        # a coin the C pump (`_httppump.c`) flipped for the next request and found picked:
        # `start` goes on from it instead of flipping again (one draw a request)
        self.drawn: float | None = None

    def start(
        self,
        verb: bytes,
        target: bytes,
        method: str,
        model: str | None,
        block: bytes,
        body_length: int | None,
    ) -> tuple[Call, bytes]:
        """A request's header block (checked by llhttp) is complete: open its call; returns it
        and the header lines the observer wants added (b"" for none). `body_length`: the
        Content-Length (None: chunked)."""
        self.count += 1
        metrics = self.metrics
        call = Call(self.count, metrics.method_label(method), model, verb == b"HEAD")
        self.open.append(call)
        metrics.http_open += 1
        observer = self.observer
        if observer is None:
            return call, b""
        quick = getattr(observer, "quick", None)
        if quick is not None:  # the hook lets the relay answer what it would not pick
            method = call.method
            if method in quick.per_call:
                coin = quick.coin
                force = coin.hot.force_header
                if force is None or b"\n" + force + b":" not in block.lower():
                    draw = self.drawn
                    if draw is None:
                        draw = coin.rand()
                    else:
                        self.drawn = None
                    if draw >= coin.hot.pick_rate:
                        quick.started[0] += 1
                        call.quiet = quick.unpicked
                        return call, b""
                    quick.coin_picked = True  # the hook must not flip again
                    try:
                        return self._ask(observer, call, verb, target, block, body_length)
                    finally:
                        quick.coin_picked = False
            elif method not in quick.replayable:
                quick.started[0] += 1
                call.quiet = quick.not_replayable
                return call, b""
        return self._ask(observer, call, verb, target, block, body_length)

    def _ask(
        self, observer: ConnectionObserver, call: Call, verb: bytes, target: bytes, block: bytes,
        body_length: int | None,
    ) -> tuple[Call, bytes]:  # fmt: skip
        """`start`'s call into the hook."""
        metrics = self.metrics
        call.start_ns = time.time_ns()
        call.path = path = target.decode("utf-8", "replace")
        raw = [(b":method", verb), (b":path", target), *header_fields(block)]
        start = _record(RequestStart, (self.connection_id, call.sid, path, call.method, raw))
        try:
            decision = observer.on_request_headers(start)
        except Exception:
            metrics.observer_errors["request_headers"] += 1
            log.exception("observer.on_request_headers failed")
            return call, b""
        if decision is None:
            return call, b""
        if type(decision) is QuietEnd:
            call.quiet = decision
            return call, b""
        assert isinstance(decision, HeaderDecision)
        if decision.capture_body:
            call.sampled = True
            if body_length is None or body_length <= decision.capture_limit:
                call.body = bytearray()
                call.capture_limit = decision.capture_limit
        if not decision.extra_headers:
            return call, b""
        try:
            return call, extra_header_bytes(decision.extra_headers)
        except ValueError:
            metrics.observer_errors["request_headers"] += 1
            log.exception("observer returned an invalid header field")
            return call, b""

    def request_done(self, call: Call, body: bytes | None) -> None:
        """The request's last byte was forwarded; `body`: its captured payload (or None)."""
        call.request_end = time.perf_counter()
        call.body = None
        if body is None or self.observer is None:
            return
        if len(body) > call.capture_limit:
            log.info("request body of call %d exceeds the capture limit", call.sid)
            return
        try:
            self.observer.on_request_body(call.sid, call.model, body)
        except Exception:
            self.metrics.observer_errors["request_body"] += 1
            log.exception("observer.on_request_body failed")

    def response_done(self, call: Call) -> None:
        """The final response of the head call ended."""
        error = call.error
        text = error_text(bytes(error)) if error else ""
        self.end(call, grpc_code(call.status, text), text)

    def end(self, call: Call, code: str, message: str = "") -> None:
        """Count one ended call and tell the observer (once; the call leaves the FIFO)."""
        opened = self.open
        if opened and opened[0] is call:
            opened.popleft()
        elif call in opened:
            opened.remove(call)
        else:
            return
        metrics = self.metrics
        metrics.http_open -= 1
        duration = time.perf_counter() - call.start
        label = metrics.model_label(call.model)
        metrics.http.record(
            call.method, label, code, duration, call.request_bytes, call.response_bytes
        )
        quiet = call.quiet
        if quiet is not None:
            quiet.ended[quiet.index] += 1
            if (per_model := quiet.per_model) is not None:
                per_model[label] = per_model.get(label, 0) + 1
            return
        observer = self.observer
        if observer is None:
            return
        start = call.start
        end = _record(StreamEnd, (
            self.connection_id, call.sid, call.path, call.method, call.model, code,
            message[:MAX_ERROR_TEXT], call.start_ns, duration, call.request_bytes,
            call.response_bytes, call.sampled,
            call.request_end - start if call.request_end else None,
            call.response_start - start if call.response_start else None,
        ))  # fmt: skip
        try:
            observer.on_stream_end(end)
        except Exception:
            metrics.observer_errors["stream_end"] += 1
            log.exception("observer.on_stream_end failed")

    def close(self, code: str) -> None:
        """The connection is gone (or no longer observed): end every open call with `code`.
        A call whose ending raises (the hook's quiet counts, say) leaves the FIFO uncounted
        (`xsp_observer_errors_total{hook="stream_end"}`); the others still end."""
        opened = self.open
        while opened:
            call = opened[0]
            try:
                self.end(call, code)
            except Exception:
                self.metrics.observer_errors["stream_end"] += 1
                log.exception("ending call %d of connection %d failed", call.sid,
                              self.connection_id)  # fmt: skip
                if opened and opened[0] is call:
                    opened.popleft()
