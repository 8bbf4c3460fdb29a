"""A stream is many inferences: per-inference accounting of one `ModelStreamInfer` stream.

Each request message is one inference, labelled with the model its own message names. A
response is matched to a pending request by its `id` where the client set one, otherwise in
order. It ends the inference when it carries `triton_final_response: true`, an error, or no
final flag at all (a backend that answers once). A decoupled model answers 0..N times; Triton
sends the final flag as an empty response only when the request asked for
`triton_enable_empty_final_response`. When it did not, every response says "not final": the
inference ends at its last response seen, once a response to a later request, the stream's end
or the table's bound shows it is over, and counts in `xsp_final_response_unseen_total`.
Without ids, responses of such requests to several pipelined requests cannot be told apart:
the first response goes to the oldest request still unanswered.

An inference still pending when the stream ends takes the stream's status (its latency runs to
the stream's end). The pending table holds at most `max_pending` inferences: beyond that the
oldest is ended (`xsp_stream_anomalies_total{reason="overflow"}` when it had not finished) and
counted, so memory stays flat whatever a client sends. Nothing here ever stops forwarding: a
message that cannot be read, a response for no pending request, a stream cut inside a message
and a cancelled stream are counted as anomalies.

A stream given a `MessageSampling` (the sampling observer's, `sample_with`) has each request
message offered to it: `pick` at the message's prefix (a coin flip: nothing is copied unless
it says so), `message` at its end (the decision, counted), and, for a message it took,
`ended` with the inference's `InferenceEnd` (its responses' times and gaps). Its exceptions
are logged and counted (`xsp_observer_errors_total{hook="stream_message"}`), never raised.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from sidecar.proxy.metrics import CallStats, ProxyMetrics
from sidecar.proxy.model_name import UNKNOWN_MODEL
from sidecar.proxy.stream_messages import request_reader, response_reader
from sidecar.proxy.stream_metrics import Histogram

log = logging.getLogger(__name__)

MAX_PENDING = 1024  # inferences in flight per stream held for matching
ERROR_CODE = "UNKNOWN"  # a message's error carries text only; gRPC's code for that
MAX_GAPS = 256  # gaps between responses kept per sampled inference (the count goes on)


@dataclass(frozen=True, slots=True)
class InferenceEnd:
    """A sampled inference as the relay saw it; times are `time.perf_counter()` seconds."""

    start: float  # its request message's end passed to the backend
    end: float  # its final response (or the stream's end)
    code: str  # gRPC code: OK, UNKNOWN for an error response, else the stream's status
    error: str  # the response's error_message
    request_bytes: int
    response_bytes: int
    responses: int
    first: float  # first response (0: none)
    last: float  # last response (0: none)
    gaps: list[float]  # between consecutive responses, the first `MAX_GAPS`


class MessageSampling(Protocol):
    """The sampling hook of one inference stream (see module docstring)."""

    capture_limit: int  # a picked message larger than this is not kept whole

    def pick(self, size: int) -> tuple[object, bool] | None:
        """At a request message's prefix: None, or a token for the message and whether to
        keep the whole message."""

    def message(self, token: object, model: str | None, full: bytes | None) -> object:
        """Every request message at its end (`full`: the whole message if picked and within
        the limit): the decision. A non-None result is handed back to `ended`."""

    def ended(self, sample: object, end: InferenceEnd) -> None:
        """A message `message` took has ended."""


class Labels:
    """One model's label pair on a stream and its counters, looked up once per stream: each
    is bound on its first use, so a pair appears on /metrics exactly when it did before."""

    __slots__ = ("first", "gaps", "model", "ok", "pair", "stats")

    def __init__(self, method: str, model: str) -> None:
        self.model = model  # bounded label value
        self.pair = (method, model)
        self.ok = (method, model, "OK")  # the usual `xsp_requests_total` key
        self.stats: CallStats | None = None
        self.first: Histogram | None = None
        self.gaps: Histogram | None = None


@dataclass(slots=True)
class Pending:
    """One inference waiting for (more of) its responses."""

    labels: Labels
    id: str
    start: float  # perf_counter at its request message
    request_bytes: int
    final_flag_asked: bool
    responses: int = 0
    first: float = 0.0
    last: float = 0.0  # perf_counter at the latest response (0: none yet)
    response_bytes: int = 0
    sample: object = None  # what `MessageSampling.message` returned
    gaps: list[float] | None = None  # kept for a sampled inference only
    error: str = ""


class StreamInferences:
    """The pending table and accounting of one inference stream (relay thread only)."""

    def __init__(self, metrics: ProxyMetrics, method: str, max_pending: int = MAX_PENDING) -> None:
        self.metrics = metrics
        self.stream_metrics = metrics.streams
        self.method = method
        self.max_pending = max_pending
        self.requests = request_reader()
        self.responses = response_reader()
        self.pending: dict[int, Pending] = {}  # by arrival sequence, oldest first
        self.by_id: dict[str, int] = {}
        self._seq = 0
        self.request_count = 0
        self.response_count = 0
        self.sampling: MessageSampling | None = None
        self._labels: dict[str | None, Labels] = {}  # by model name as read (None: unreadable)

    def sample_with(self, sampling: MessageSampling) -> None:
        """Offer each request message from now on to `sampling`."""
        self.sampling = sampling
        self.requests.pick = sampling.pick
        self.requests.capture_limit = sampling.capture_limit

    def _hook_failed(self) -> None:
        self.metrics.observer_errors["stream_message"] += 1
        log.exception("a stream message's sampling hook failed")

    # -- requests -------------------------------------------------------------------------

    def request_data(self, chunk: bytes) -> None:
        """Client DATA payload bytes of the stream."""
        reads = self.requests.read(chunk)
        if not reads:
            return
        now = time.perf_counter()
        pending = self.pending
        sampling = self.sampling
        labels = self._labels
        for size, token, full, name, ident, asked in reads:
            self.request_count += 1
            if name is None:
                self.stream_metrics.unreadable.inc()
            else:
                name = name or None
            lab = labels.get(name)
            if lab is None:
                lab = self._labels_of(name)
            if len(pending) >= self.max_pending:
                self._evict(now)
            seq = self._seq
            self._seq = seq + 1
            p = pending[seq] = Pending(lab, ident, now, size, asked)
            if sampling is not None:
                try:
                    p.sample = sampling.message(token, name, full)
                except Exception:
                    self._hook_failed()
                if p.sample is not None:
                    p.gaps = []
            if ident and ident not in self.by_id:
                self.by_id[ident] = seq

    def _labels_of(self, name: str | None) -> Labels:
        model = UNKNOWN_MODEL if name is None else self.metrics.model_label(name)
        lab = Labels(self.method, model)
        if len(self._labels) < self.metrics.max_models:  # bounded like the label values
            self._labels[name] = lab
        return lab

    # -- responses ------------------------------------------------------------------------

    def response_data(self, chunk: bytes) -> None:
        """Backend DATA payload bytes of the stream."""
        reads = self.responses.read(chunk)
        if not reads:
            return
        now = time.perf_counter()
        sm = self.stream_metrics
        method = self.method
        responses = sm.responses
        for size, error, model, ident, final, has_outputs in reads:
            self.response_count += 1
            if model is None:
                sm.unreadable.inc()
                continue
            seq = self._match(ident)
            if seq is None:
                sm.unmatched.inc()
                pair = (method, self.metrics.model_label(model))
                responses[pair] = responses.get(pair, 0) + 1
                continue
            p = self.pending[seq]
            p.response_bytes += size
            if has_outputs or error:
                lab = p.labels
                pair = lab.pair
                responses[pair] = responses.get(pair, 0) + 1
                if p.responses == 0:
                    p.first = now
                    hist = lab.first
                    if hist is None:
                        hist = lab.first = sm.histogram(sm.first_response, pair)
                    hist.observe(now - p.start)
                else:
                    gap = now - p.last
                    hist = lab.gaps
                    if hist is None:
                        hist = lab.gaps = sm.histogram(sm.gaps, pair)
                    hist.observe(gap)
                    if p.gaps is not None and len(p.gaps) < MAX_GAPS:
                        p.gaps.append(gap)
                p.responses += 1
                p.last = now
            if error:
                p.error = error
                self._finish(seq, ERROR_CODE, now)
            elif final is not False:
                self._finish(seq, "OK", now)

    def _match(self, ident: str) -> int | None:
        """The pending inference a response belongs to; ends older ones it shows are over."""
        pending = self.pending
        if ident:
            seq = self.by_id.get(ident)
            if seq is None:  # a duplicate id whose first holder has ended
                seq = next((s for s, p in pending.items() if p.id == ident), None)
                if seq is None:
                    return None
        else:
            seq = None
            for s, p in pending.items():
                if not p.id and (p.final_flag_asked or p.responses == 0):
                    seq = s
                    break
            if seq is None:  # more responses to the latest answered request
                seq = next((s for s in reversed(pending) if not pending[s].id), None)
                if seq is None:
                    return None
        # Older requests whose final response cannot be seen and that were answered are over:
        # a response to a later request has come.
        done = []
        for s, p in pending.items():
            if s >= seq:
                break
            if p.responses and not p.final_flag_asked and (p.id == "") == (ident == ""):
                done.append(s)
        if done:
            now = time.perf_counter()
            for s in done:
                self._finish(s, "OK", now, at_last=True)
        return seq

    # -- ends -----------------------------------------------------------------------------

    def _finish(self, seq: int, code: str, now: float, at_last: bool = False) -> None:
        p = self.pending.pop(seq)
        if p.id and self.by_id.get(p.id) == seq:
            del self.by_id[p.id]
        lab = p.labels
        end = now
        if at_last:
            end = p.last
            unseen = self.stream_metrics.final_unseen
            unseen[lab.pair] = unseen.get(lab.pair, 0) + 1
        st = lab.stats
        if st is None:
            st = lab.stats = self.metrics.call_stats(self.method, lab.model)
        key = lab.ok if code == "OK" else (self.method, lab.model, code)
        self.metrics.record_in(st, key, end - p.start, p.request_bytes, p.response_bytes)
        if p.sample is not None:
            self._ended(p, code, end)

    def _ended(self, p: Pending, code: str, end: float) -> None:
        assert self.sampling is not None
        result = InferenceEnd(
            p.start, end, code, p.error, p.request_bytes, p.response_bytes, p.responses,
            p.first, p.last, p.gaps or [],
        )  # fmt: skip
        try:
            self.sampling.ended(p.sample, result)
        except Exception:
            self._hook_failed()

    def _evict(self, now: float) -> None:
        seq = next(iter(self.pending))
        p = self.pending[seq]
        if p.responses and not p.final_flag_asked:
            self._finish(seq, "OK", now, at_last=True)  # answered; its end just not seen
            return
        self.stream_metrics.overflow.inc()
        self.pending.pop(seq)
        if p.id and self.by_id.get(p.id) == seq:
            del self.by_id[p.id]
        # no latency: its end is unknown
        self.metrics.count(self.method, p.labels.model, ERROR_CODE)
        if p.sample is not None:
            p.error = "evicted from the stream's pending table"
            self._ended(p, ERROR_CODE, now)

    def close(self, code: str, lifetime_s: float) -> None:
        """The stream has ended with gRPC status `code`: end what is pending, count it."""
        now = time.perf_counter()
        sm = self.stream_metrics
        if self.requests.mid_message or self.responses.mid_message:
            sm.cut.inc()
        if code == "CANCELLED" and self.pending:
            sm.cancelled.inc()
        for seq in list(self.pending):
            p = self.pending[seq]
            if p.responses and not p.final_flag_asked and code == "OK":
                self._finish(seq, "OK", now, at_last=True)
            else:
                self._finish(seq, code, now)
        sm.stream_ended(self.method, code, lifetime_s, self.request_count, self.response_count)
